"""LoRA on the GPU: parity with PEFT and heterogeneous batch invariance (CUDA only; `python -m pytest tests/gpu`).

The CPU suite (tests/lora) covers every PEFT option; here a representative set runs on CUDA: float32
must match PEFT exactly (tokens) and closely (logits); bfloat16 must agree on the first tokens.
"""

import pathlib
import random

import pytest
import torch

from loraplex.params import SamplingParams
from tests.helpers import engine_for, full_logits, ours_from_hf, tiny_hf_model
from tests.lora.peft_helpers import ALL_PROJECTIONS, peft_from_dir, peft_model

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

DEVICE = "cuda"
ALL = list(ALL_PROJECTIONS)
CASES = {
    "r4": dict(r=4, lora_alpha=8, target_modules=ALL),
    "r16_q_v": dict(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "r64_rslora": dict(r=64, lora_alpha=32, use_rslora=True, target_modules=ALL),
    "patterns": dict(r=8, lora_alpha=16, target_modules=ALL, rank_pattern={"q_proj": 4}, alpha_pattern={"v_proj": 64}),
    "layers_to_transform": dict(r=8, lora_alpha=16, target_modules=ALL, layers_to_transform=[1]),
    "lm_head": dict(r=8, lora_alpha=16, target_modules=[*ALL, "lm_head"]),
}
PROMPT = [1, 17, 203, 45, 9, 88, 130, 7, 251, 64, 3, 99, 180, 42, 5, 77, 211, 8, 150, 33]
NEW_TOKENS = 12


def _adapter(hf, tmp: pathlib.Path, name: str, seed: int, base_shapes, base_weight, **lora_kwargs):
    """(our adapter read from PEFT's files, PEFT's model reloaded from the same files)."""
    from loraplex.lora.adapter import load_adapter_dir

    directory = tmp / name
    peft_model(hf, seed, **lora_kwargs).save_pretrained(str(directory))
    ours = load_adapter_dir(directory, name, base_shapes, 64, base_weight)
    return ours, peft_from_dir(hf, directory)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_adapters_match_peft_on_cuda(tmp_path, dtype):
    hf = tiny_hf_model("llama", seed=0, num_hidden_layers=3)
    ours, config = ours_from_hf(hf, device=DEVICE, dtype=dtype)
    engine = engine_for(ours, config, device=DEVICE, dtype=dtype, max_active_adapters=len(CASES))
    base_weight = lambda m: ours.get_submodule(m).weight  # noqa: E731
    adapters, references = [], []
    for seed, (name, kwargs) in enumerate(CASES.items()):
        adapter, reference = _adapter(hf, tmp_path, name, seed + 1, engine.lora.base_shapes, base_weight, **kwargs)
        adapters.append(adapter)
        references.append(reference.to(DEVICE, dtype))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    agree = 0
    # All adapters and the base model in one batch.
    results = engine.generate([PROMPT] * (len(CASES) + 1), params, adapters=[*adapters, None])
    with torch.inference_mode():
        base_tokens = hf.to(DEVICE, dtype).generate(
            torch.tensor([PROMPT], device=DEVICE), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0
        )[0, len(PROMPT):].tolist()
        for adapter, reference, result in zip(adapters, references, results):
            expected = reference(torch.tensor([PROMPT], device=DEVICE)).logits[0].float()
            got = full_logits(ours, config, PROMPT, DEVICE, adapter=adapter)
            tolerance = 1e-4 if dtype is torch.float32 else 6e-2
            torch.testing.assert_close(got, expected, atol=tolerance * max(1.0, expected.abs().max().item()), rtol=0)
            want = reference.generate(
                torch.tensor([PROMPT], device=DEVICE), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0
            )[0, len(PROMPT):].tolist()
            if dtype is torch.float32:
                assert result.token_ids == want, adapter.adapter_id
                assert want != base_tokens, f"{adapter.adapter_id} does not change the output: the test proves nothing"
            else:  # bf16: a random tiny model has near-ties, so the logits above are the check; tokens mostly agree
                agree += result.token_ids[0] == want[0]
    if dtype is torch.float32:
        assert results[-1].token_ids == base_tokens
    else:
        assert agree >= len(CASES) // 2, f"only {agree} of {len(CASES)} first tokens agree with PEFT in bf16"


def test_heterogeneous_batch_equals_solo_on_cuda():
    """32 requests over 8 adapters and the base model, mixed lengths: each equals its solo run (float32)."""
    from loraplex.lora.adapter import LoraAdapter, LoraConfig, LoraWeights

    hf = tiny_hf_model("llama", seed=3)
    ours, config = ours_from_hf(hf, device=DEVICE)
    engine = engine_for(ours, config, device=DEVICE, max_active_adapters=8)
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    adapters: list[LoraAdapter | None] = [None]
    for i in range(8):
        rank = (4, 8, 16)[i % 3]
        modules = {
            name: LoraWeights(torch.randn(rank, fan_in, generator=generator) / fan_in**0.5,
                              torch.randn(fan_out, rank, generator=generator) * 0.5, 1.0)
            for name, (fan_in, fan_out) in engine.lora.base_shapes.items()
            if name == "lm_head" or name.endswith(ALL[i % 7]) or i % 2 == 0
        }
        adapters.append(LoraAdapter(f"a{i}", modules, LoraConfig(r=rank, lora_alpha=rank)))
    requests = [
        ([rng.randrange(1, 256) for _ in range(rng.randint(3, 60))], rng.randint(1, 14), adapters[i % 9])
        for i in range(32)
    ]
    batched = engine.generate(
        [p for p, _, _ in requests], [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n, _ in requests],
        adapters=[a for _, _, a in requests],
    )
    for (prompt, n, adapter), result in zip(requests, batched):
        (solo,) = engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True), adapters=[adapter])
        assert result.token_ids == solo.token_ids
