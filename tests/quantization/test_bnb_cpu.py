"""--quantize on the CPU: bitsandbytes 0.50.2 runs all three modes here (int8 LLM.int8, nf4, fp4), in float32
and bfloat16, so each is checked against transformers loading the same checkpoint with the same
BitsAndBytesConfig (device_map="cpu"):

- float32: our logits equal transformers' to 1e-4 x max(1, |logits|) (measured <= 5e-7) and greedy tokens are
  identical; the quantization itself moves the logits by 1e-2 (int8) to 2e-1 (fp4), so the comparison bites;
- bfloat16: logits within 5e-2 (measured <= 1.7e-2, bfloat16 rounding) and argmaxes agree;
- LoRA on top equals PEFT on the same transformers-quantized model (float32: 1e-4, measured <= 5e-7; bfloat16:
  5e-2, measured <= 2.3e-2);
- a batch mixing adapter and base requests gives each its solo tokens (LLM.int8: see its own test);
- LLaVA-NeXT's vision tower and projector, and T5 (its `wo` kept), are quantized as transformers does;
- the embedded SmolLM2 through load_model (real weights) gives transformers' tokens.
Refusals (unknown mode, bitsandbytes missing, a device it cannot run on) are one clean line, CLI included.
"""

from __future__ import annotations

import pathlib
import random
import sys

import pytest
import torch
from torch import nn

from loraplex.checkpoints.sources import resolve_model
from loraplex.checkpoints.weights import load_state_dict
from loraplex.config import EngineConfig
from loraplex.models.config import ModelConfig
from loraplex.engine.loading import build_model, load_model
from loraplex.models.registry import config_from_hf
from loraplex.lora.step.layers import LoraLinear
from loraplex.lora.device.table import AdapterTable
from loraplex.params import SamplingParams
from loraplex.quantization import (
    BITSANDBYTES_MODES,
    QuantizationError,
    check_quantize,
    default_skip,
    dequantized_weight,
    is_quantized,
    quantize_model,
    weight_bytes,
)
from loraplex.quantization.bnb.mode import keep_cpu_4bit_packable
from tests.helpers import engine_for, full_logits, tiny_hf_model, tiny_mpt
from tests.lora.peft_helpers import ALL_PROJECTIONS, peft_model, reference_greedy, reference_logits, save_and_load

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # PEFT and bitsandbytes notes on quantized layers
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

MODES = list(BITSANDBYTES_MODES)
PROMPT = [1, 17, 203, 45, 9, 88, 130, 7, 251, 64, 3, 99, 180, 42, 5, 77, 211, 8, 150, 33, 120]  # crosses a KV block
NEW = 8
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


def llama_with_outlier_features():
    """A tiny Llama whose norms feed a few channels ~12x larger than the rest, as trained LLMs have (the
    "outlier features" LLM.int8 was made for): values past its 6.0 threshold reach the linears, so its
    mixed int8/float decomposition runs and is compared too."""
    model = tiny_hf_model("llama", seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[[3, 40]] *= 12
            layer.post_attention_layernorm.weight[[7]] *= 12
    return model


FAMILIES = {  # name -> (tiny transformers model, the linears an adapter targets)
    "llama": (llama_with_outlier_features, list(ALL_PROJECTIONS)),
    "mpt": (lambda: tiny_mpt(seed=1), ["Wqkv", "out_proj", "up_proj", "down_proj"]),
}


def bnb_config(mode: str, dtype: torch.dtype):
    if mode == "bitsandbytes":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=mode.rsplit("-", 1)[1], bnb_4bit_compute_dtype=dtype
    )


def hf_quantized(path, mode: str, dtype: torch.dtype, cls=None):
    """transformers' quantized model; its tiny 4-bit layers take bitsandbytes' generic CPU path, as ours do (the
    packed one of AVX512-BF16 CPUs cannot take their shapes)."""
    cls = cls or transformers.AutoModelForCausalLM
    model = cls.from_pretrained(
        path, quantization_config=bnb_config(mode, dtype), device_map="cpu", dtype=dtype, attn_implementation="eager"
    ).eval()
    keep_cpu_4bit_packable(model)
    return model


def ours_from_dir(path, dtype: torch.dtype, mode: str | None = None) -> tuple[nn.Module, ModelConfig]:
    """Our model from a saved checkpoint, as load_model builds it (weights in `dtype`), quantized with `mode`."""
    source = resolve_model(path)
    config = config_from_hf(source.hf_config)
    model = build_model(config, load_state_dict(source, dtype=dtype))
    if mode is not None:
        quantize_model(model, mode, "cpu", dtype)
    return model, config


def quantized_names(model) -> list[str]:
    return sorted(name for name, m in model.named_modules() if is_quantized(m))


def atol(expected: torch.Tensor, scale: float = 1e-4) -> float:
    return scale * max(1.0, expected.abs().max().item())


def float32_scale(mode: str) -> float:
    """The relative tolerance of a float32 comparison through `mode`'s linears. On CPUs with AVX512-BF16,
    bitsandbytes' Linear4bit repacks its weights for a bfloat16 kernel in eval mode and multiplies in bfloat16
    whatever the compute dtype (bitsandbytes 0.50, backends/cpu/ops.py): both sides then round each 4-bit product's
    input to bfloat16, and inputs a float32 rounding apart can round a bfloat16 step apart (2^-8, relative)."""
    import bitsandbytes.functional

    four_bit = mode.endswith(("nf4", "fp4"))
    return 2e-3 if four_bit and bitsandbytes.functional.has_avx512bf16() else 1e-4


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[object, pathlib.Path, list[str]]]:
    """Each tiny family's transformers model (float32), saved once."""
    out = {}
    for name, (make, targets) in FAMILIES.items():
        hf = make()
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        out[name] = (hf, path, targets)
    return out


def prompts(n: int = 4) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(4, 24))] for _ in range(n)]


# ---- the base model against transformers ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_float32_matches_transformers(saved, family, mode):
    hf, path, _ = saved[family]
    ours, config = ours_from_dir(path, torch.float32, mode)
    reference = hf_quantized(path, mode, torch.float32)
    # The same linears quantized (every one but the output head), the same way.
    assert quantized_names(ours) == quantized_names(reference) and quantized_names(ours)
    assert not is_quantized(ours.lm_head)

    want = reference_logits(reference, PROMPT)
    got = full_logits(ours, config, PROMPT)
    tolerance = atol(want)
    torch.testing.assert_close(got, want, atol=tolerance, rtol=0)
    unquantized, _ = ours_from_dir(path, torch.float32)
    moved = (full_logits(unquantized, config, PROMPT) - got).abs().max().item()
    assert moved > 10 * tolerance, f"{mode} barely changes the logits ({moved:.2g}): the comparison would not bite"

    engine = engine_for(ours, config, max_batch_total_tokens=1024)
    ps = prompts(3)
    tokens = [o.token_ids for o in engine.generate(ps, PARAMS)]
    assert tokens == [reference_greedy(reference, p, NEW) for p in ps]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_close_to_transformers(saved, family, mode):
    _, path, _ = saved[family]
    ours, config = ours_from_dir(path, torch.bfloat16, mode)
    reference = hf_quantized(path, mode, torch.bfloat16)
    want = reference_logits(reference, PROMPT)
    got = full_logits(ours, config, PROMPT)
    assert got.dtype == torch.float32 and next(ours.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=atol(want, 5e-2), rtol=0)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"argmax agrees at {agree:.0%} of positions"


# ---- LoRA on top ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_quantized_model_matches_peft(saved, tmp_path, family, mode):
    hf, path, targets = saved[family]
    ours, config = ours_from_dir(path, torch.float32, mode)
    reference = hf_quantized(path, mode, torch.float32)
    trained = peft_model(reference, seed=MODES.index(mode) + 1, r=8, lora_alpha=16, target_modules=targets)
    engine = engine_for(ours, config, max_batch_total_tokens=1024, max_active_adapters=2)
    adapter = save_and_load(trained, tmp_path, "a", engine.lora.base_shapes, base_weight=lambda m: ours.get_submodule(m).weight)
    assert all(is_quantized(engine.lora.layers[m].base) for m in adapter.modules)  # LoRA on quantized linears

    want = reference_logits(trained, PROMPT)
    got = full_logits(ours, config, PROMPT, adapter=adapter)
    torch.testing.assert_close(got, want, atol=atol(want, float32_scale(mode)), rtol=0)
    assert (want - reference_logits(reference, PROMPT)).abs().max() > 100 * atol(want), "the adapter barely matters"

    # Through the engine: alone, PEFT's tokens (with the adapter) and the quantized base's (without); in a batch
    # mixing both, each request's solo tokens. LLM.int8 picks its outlier columns over all rows of a step, so
    # there a request may move with its batch (see test_int8_outlier_columns_are_chosen_over_the_batch):
    # this tiny Llama's outlier features make one of these requests differ, at its 9th token.
    ps = prompts(4)
    adapters = [adapter, None, adapter, None]
    solo = [engine.generate([p], PARAMS, adapters=[a])[0].token_ids for p, a in zip(ps, adapters)]
    assert solo[:2] == [reference_greedy(trained, ps[0], NEW), reference_greedy(reference, ps[1], NEW)]
    together = [o.token_ids for o in engine.generate(ps, PARAMS, adapters=adapters)]
    if mode == "bitsandbytes":
        assert sum(t == s for t, s in zip(together, solo)) >= len(ps) - 1
    else:
        assert together == solo


@pytest.mark.parametrize("mode", MODES)
def test_lora_on_quantized_model_bfloat16(saved, tmp_path, mode):
    _, path, targets = saved["llama"]
    ours, config = ours_from_dir(path, torch.bfloat16, mode)
    reference = hf_quantized(path, mode, torch.bfloat16)
    trained = peft_model(reference, seed=7, r=8, lora_alpha=16, target_modules=targets)
    shapes = AdapterTable(ours, 1, torch.device("cpu"), torch.bfloat16).base_shapes
    adapter = save_and_load(trained, tmp_path, "a", shapes)
    want = reference_logits(trained, PROMPT)
    got = full_logits(ours, config, PROMPT, adapter=adapter)
    torch.testing.assert_close(got, want, atol=atol(want, 5e-2), rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


# ---- vision: LLaVA-NeXT's tower and projector are quantized too, as transformers 5 does ----------------------


@pytest.mark.parametrize("mode", ["bitsandbytes", "bitsandbytes-nf4"])
def test_llava_next_quantized_like_transformers(tmp_path, mode):
    from tests.models.test_llava_next_parity import WIDE, hf_logits, image, inputs, paged_logits, processor, tiny_llava

    hf = tiny_llava(seed=0)
    hf.save_pretrained(tmp_path)
    ours, config = ours_from_dir(tmp_path, torch.float32, mode)
    reference = hf_quantized(tmp_path, mode, torch.float32, transformers.LlavaNextForConditionalGeneration)
    names = quantized_names(ours)
    assert names == quantized_names(reference)
    assert any(".vision_tower." in n for n in names) and any(".multi_modal_projector." in n for n in names)

    ids, pixel_values, sizes = inputs(processor(), "w5 w17 <image> w3 w99 w42", [image(WIDE, 1)])
    want = hf_logits(reference, ids, pixel_values, sizes)
    got = paged_logits(ours, config, ids, pixel_values, sizes)
    torch.testing.assert_close(got, want, atol=atol(want), rtol=0)
    unquantized, _ = ours_from_dir(tmp_path, torch.float32)
    assert (paged_logits(unquantized, config, ids, pixel_values, sizes) - got).abs().max() > 10 * atol(want)


# ---- encoder-decoder: T5 keeps its `wo` unquantized (keep_unquantized), as transformers' _keep_in_fp32_modules ----


@pytest.mark.parametrize("mode", ["bitsandbytes", "bitsandbytes-nf4"])
@pytest.mark.parametrize("gated", [False, True], ids=["t5-v1.0", "t5-v1.1"])
def test_t5_quantized_like_transformers(tmp_path, gated, mode):
    from tests.helpers import encoder_decoder_logits, tiny_t5

    tiny_t5(gated=gated).save_pretrained(tmp_path)
    ours, config = ours_from_dir(tmp_path, torch.float32, mode)
    reference = hf_quantized(tmp_path, mode, torch.float32, transformers.T5ForConditionalGeneration)
    names = quantized_names(ours)
    assert names == quantized_names(reference) and not any(n.endswith(".wo") for n in names)
    encoder_ids, decoder_ids = PROMPT[1:] + [1], [0, 7, 99, 42, 18, 3, 250]
    with torch.inference_mode():
        want = reference(input_ids=torch.tensor([encoder_ids]), decoder_input_ids=torch.tensor([decoder_ids])).logits[0]
    got = encoder_decoder_logits(ours, config, encoder_ids, decoder_ids)
    torch.testing.assert_close(got, want.float(), atol=atol(want), rtol=0)


@pytest.mark.parametrize("mode", ["bitsandbytes", "bitsandbytes-nf4"])
def test_bart_quantized_like_transformers(tmp_path, mode):
    from tests.helpers import encoder_decoder_logits
    from tests.models.test_bart_parity import tiny_bart

    tiny_bart(seed=2).save_pretrained(tmp_path)
    ours, config = ours_from_dir(tmp_path, torch.float32, mode)
    reference = hf_quantized(tmp_path, mode, torch.float32, transformers.BartForConditionalGeneration)
    names = quantized_names(ours)
    assert names and names == quantized_names(reference)
    encoder_ids, decoder_ids = [0] + PROMPT[1:] + [2], [2, 7, 99, 42, 18, 3, 250]
    with torch.inference_mode():
        want = reference(input_ids=torch.tensor([encoder_ids]), decoder_input_ids=torch.tensor([decoder_ids])).logits[0]
    got = encoder_decoder_logits(ours, config, encoder_ids, decoder_ids)
    torch.testing.assert_close(got, want.float(), atol=atol(want), rtol=0)


# ---- a real model through load_model ----------------------------------------------------------------------


def test_embedded_model_through_load_model_gives_transformers_tokens(embedded):
    """SmolLM2-135M (real weights) loaded with EngineConfig(quantize=...) as the server loads it: transformers'
    greedy tokens. nf4 here; LLM.int8 on real weights is slow on this CPU (its int8 matmul runs in float32)."""
    mode = "bitsandbytes-nf4"
    logs: list[str] = []
    loaded = load_model(EngineConfig(device="cpu", quantize=mode), log=logs.append)
    assert any(line.startswith("quantized 210 linears (bitsandbytes-nf4)") for line in logs), logs
    assert weight_bytes(loaded.model) < 0.6 * weight_bytes(embedded.model)  # the 28M-parameter embedding stays float32
    engine = engine_for(loaded.model, loaded.config, loaded.tokenizer, max_batch_total_tokens=1024)
    tok = loaded.tokenizer
    ps = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
          for q in ("What is the capital of France?", "List three prime numbers.")]
    tokens = [o.token_ids for o in engine.generate(ps, PARAMS)]
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        resolve_model(None).path, quantization_config=bnb_config(mode, torch.float32), device_map="cpu",
        dtype=torch.float32,
    ).eval()
    assert tokens == [reference_greedy(reference, p, NEW) for p in ps]


# ---- the parts --------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wi, self.wo = nn.Linear(8, 16), nn.Linear(16, 8)


class _Model(nn.Module):
    keep_unquantized = ("wo",)

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.two = nn.Linear(8, 8)  # "two" ends in "wo" but is not named "wo"
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: never quantized
        self.lm_head = nn.Linear(8, 10, bias=False)


def test_what_stays_unquantized():
    model = _Model()
    skip = default_skip(model)
    assert skip("lm_head") and skip("blocks.0.wo") and not skip("blocks.0.wi") and not skip("two")
    assert quantize_model(model, "bitsandbytes-nf4", "cpu", torch.float32) == 3
    assert quantized_names(model) == ["blocks.0.wi", "blocks.1.wi", "two"]
    assert model.head.weight is model.embed.weight
    # An explicit skip replaces the name rule (tied weights stay kept whatever it says).
    other = _Model()
    assert quantize_model(other, "bitsandbytes", "cpu", torch.float32, skip=lambda name: name == "two") == 5
    assert "two" not in quantized_names(other) and "lm_head" in quantized_names(other)


@pytest.mark.parametrize("mode", MODES)
def test_weights_memory_and_dequantized_values(mode):
    torch.manual_seed(0)
    linear = nn.Linear(256, 128)
    model = nn.Sequential(linear)
    float_bytes = weight_bytes(model)
    assert float_bytes == (256 * 128 + 128) * 4
    quantize_model(model, mode, "cpu", torch.float32, skip=lambda name: False)
    layer = model[0]
    if mode == "bitsandbytes":  # int8 weights, a float32 scale per row (bias stays float32)
        assert weight_bytes(model) == 256 * 128 + 128 * 4 + 128 * 4
        error = linear.weight.abs().amax(1, keepdim=True) / 127 / 2 * 1.2  # (+ float16 rounding on the way)
    else:  # 4 bits per weight, a float32 absmax per block of 64, the 16-value code
        assert weight_bytes(model) == 256 * 128 // 2 + 256 * 128 // 64 * 4 + 16 * 4 + 128 * 4
        error = linear.weight.abs().amax() * 0.25
    restored = dequantized_weight(layer)
    assert restored.shape == (128, 256) and restored.dtype == torch.float32
    assert ((restored - linear.weight).abs() <= error).all()
    # LoraLinear over it: the real features, and `weight` (what base-weight checks compare) dequantized.
    wrapped = LoraLinear(layer, "0")
    assert (wrapped.in_features, wrapped.out_features) == (256, 128)
    torch.testing.assert_close(wrapped.weight, restored)
    with torch.inference_mode():
        x = torch.randn(3, 256)
        out = wrapped(x)
    assert out.dtype == x.dtype and out.shape == (3, 128)


def test_int8_outlier_columns_are_chosen_over_the_batch():
    """Why `bitsandbytes` (LLM.int8, as transformers and LoRAX run it) is not batch-invariant: a column in which
    any row of the batch holds a value past the threshold is computed unquantized for every row. A row's output
    then depends, slightly, on its neighbours; the 4-bit modes compute each row alone."""
    torch.manual_seed(0)
    for mode, invariant in (("bitsandbytes", False), ("bitsandbytes-nf4", True)):
        model = nn.Sequential(nn.Linear(64, 32)).eval()
        quantize_model(model, mode, "cpu", torch.float32, skip=lambda name: False)
        calm = torch.randn(2, 64)
        loud = torch.randn(1, 64)
        loud[0, 5] = 20.0  # an outlier in column 5
        with torch.inference_mode():
            alone, batched = model(calm), model(torch.cat([calm, loud]))[:2]
        assert torch.equal(alone, batched) == invariant, mode
        torch.testing.assert_close(batched, alone, atol=0.02, rtol=0)


# ---- refusals ---------------------------------------------------------------------------------------------


def test_check_quantize_accepts_every_mode_on_cpu_without_touching_the_seed():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    for mode in MODES:
        for dtype in (torch.float32, torch.bfloat16):
            check_quantize(mode, "cpu", dtype)
    assert torch.equal(torch.rand(3), expected)


def test_refusals_say_why(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown --quantize 'gptq'; choose one of bitsandbytes, bitsandbytes-nf4"):
        check_quantize("gptq", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"bitsandbytes-nf4: bitsandbytes \S+ cannot run it on cuda .*CUDA"):
            check_quantize("bitsandbytes-nf4", "cuda")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes now raises ImportError
    with pytest.raises(QuantizationError, match="needs bitsandbytes: pip install bitsandbytes"):
        check_quantize("bitsandbytes", "cpu")
    with pytest.raises(QuantizationError, match="pip install bitsandbytes"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), "bitsandbytes", "cpu", torch.float32)


def _cli(monkeypatch, capsys, argv, env=None) -> tuple[int, list[str]]:
    from loraplex.cli import main

    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_cli_refusal_is_one_line(saved, monkeypatch, capsys):
    _, path, _ = saved["llama"]
    base = ["generate", "hello", "--model-id", str(path)]
    code, lines = _cli(monkeypatch, capsys, [*base, "--device", "cpu"], env={"QUANTIZE": "bitsandbytes-int4"})
    assert code == 2 and lines == ["loraplex: error: unknown --quantize 'bitsandbytes-int4'; choose one of "
                                   "bitsandbytes, bitsandbytes-nf4, bitsandbytes-fp4, fp8"]
    if not torch.cuda.is_available():  # a device this machine lacks: refused before any weight is read
        code, lines = _cli(monkeypatch, capsys, [*base, "--device", "cuda", "--quantize", "bitsandbytes-nf4"])
        assert code == 2 and lines == ["loraplex: error: --device cuda: no CUDA device is available on this machine "
                                       "(try --device cpu)"]
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        _cli(monkeypatch, capsys, [*base, "--quantize", "int8"])


def test_move_unquantized_keeps_ties_and_skips_quantized_layers():
    from loraplex.quantization import move_unquantized

    hf = tiny_hf_model("llama", seed=1, tie_word_embeddings=True)
    from tests.helpers import ours_from_hf

    model, _ = ours_from_hf(hf)
    quantize_model(model, "bitsandbytes-nf4", "cpu", torch.float32)
    head = model.lm_head.weight
    assert head is model.model.embed_tokens.weight
    move_unquantized(model, "meta")  # another device, without needing one: every float tensor moves
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.device.type == "meta"
    assert all(p.device.type == "cpu" for m in model.modules() if is_quantized(m) for p in m.parameters())


def test_tiny_4bit_layers_avoid_the_packed_cpu_kernel():
    """bitsandbytes' packed 4-bit CPU kernel (AVX512-BF16 CPUs) fails on shapes it cannot tile: those layers are
    sent to its generic path, whatever CPU runs this; tileable ones keep the packed kernel."""
    model = nn.Sequential(nn.Linear(16, 24), nn.Linear(64, 64))
    quantize_model(model, "bitsandbytes-nf4", "cpu", torch.float32, skip=lambda name: False)
    for layer in model:
        layer.support_avx512bf16_for_cpu = True  # as on such a CPU
    keep_cpu_4bit_packable(model)
    assert [layer.support_avx512bf16_for_cpu for layer in model] == [False, True]
    assert model[0](torch.ones(2, 16)).shape == (2, 24)


# ---- Mllama: the vision encoder, projector and cross-attention layers are quantized too, as transformers does ----


@pytest.mark.parametrize("mode", ["bitsandbytes", "bitsandbytes-nf4"])
def test_mllama_quantized_like_transformers(tmp_path, mode):
    """nf4: logits as transformers'. LLM.int8: transformers' own model fails (its projector feeds bitsandbytes'
    int8 matmul a 5-D tensor; ours a 3-D one), so ours is checked against our float model instead."""
    from tests.helpers import engine_for, image_model_logits
    from tests.mllama_fixtures import hf_logits, mllama_processor, pictures, request_inputs, save_tiny_mllama, tiny_mllama

    processor = mllama_processor()
    save_tiny_mllama(tiny_mllama(seed=0), processor, tmp_path)
    ours, config = ours_from_dir(tmp_path, torch.float32, mode)
    reference = hf_quantized(tmp_path, mode, torch.float32, transformers.MllamaForConditionalGeneration)
    names = quantized_names(ours)
    assert names == quantized_names(reference)
    assert any(".cross_attn." in n for n in names) and any(".vision_model." in n for n in names)

    text, images = "<|image|>w1 w2 w3 w40", pictures([(30, 60)], seed=1)
    ids, inputs = request_inputs(processor, text, images)
    got = image_model_logits(engine_for(ours, config), ids, inputs)
    unquantized, _ = ours_from_dir(tmp_path, torch.float32)
    float_logits = image_model_logits(engine_for(unquantized, config), ids, inputs)
    if mode == "bitsandbytes-nf4":
        want = hf_logits(reference, processor, text, images)
        torch.testing.assert_close(got, want, atol=atol(want), rtol=0)
        assert (float_logits - got).abs().max() > 10 * atol(want)
    else:
        torch.testing.assert_close(got, float_logits, atol=0.1 * float_logits.abs().max().item(), rtol=0)
        assert not torch.equal(got, float_logits)
