"""--quantize on CUDA (`python -m pytest tests/gpu`): bitsandbytes 8-bit (LLM.int8) and nf4 on a small Llama
(4 layers, hidden 512, GQA, a few outlier feature channels as trained models have) in bfloat16, against
transformers loading the same checkpoint with the same BitsAndBytesConfig on the same GPU:

- the same linears quantized; logits close (bfloat16 tolerance) and greedy tokens mostly identical;
- LoRA on top equals PEFT on the same transformers-quantized model (logits close, first tokens identical);
- a batch mixing adapter and base requests gives (nearly) each request its solo tokens: on CUDA a one-row nf4
  matmul takes bitsandbytes' gemv kernel and a batch dequantizes and multiplies, and LLM.int8 picks its
  outlier columns over the batch, so bfloat16 ties may break differently (the CPU suite checks exactness).
"""

import random

import pytest
import torch

from loraplex.checkpoints.sources import resolve_model
from loraplex.checkpoints.weights import load_state_dict
from loraplex.engine.loading import build_model
from loraplex.models.registry import config_from_hf
from loraplex.lora.table import AdapterTable
from loraplex.quantization import is_quantized, quantize_model, weight_bytes
from tests.gpu.quantized_llama import DEVICE, DTYPE, NEW, PARAMS, PROMPT, SHAPE, tolerance
from tests.helpers import engine_for, full_logits, tiny_hf_model
from tests.lora.peft_helpers import ALL_PROJECTIONS, peft_model, save_and_load

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

transformers = pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

MODES = ["bitsandbytes", "bitsandbytes-nf4"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    hf = tiny_hf_model("llama", seed=0, **SHAPE)
    with torch.no_grad():  # outlier features: values past LLM.int8's 6.0 threshold reach the linears
        for layer in hf.model.layers:
            layer.input_layernorm.weight[[3, 200]] *= 12
            layer.post_attention_layernorm.weight[[7]] *= 12
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return path


def bnb_config(mode: str):
    if mode == "bitsandbytes":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=DTYPE)


def theirs(path, mode: str):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb_config(mode), device_map=DEVICE, dtype=DTYPE, attn_implementation="eager"
    ).eval()


def ours(path, mode: str | None):
    """As load_model does it: weights loaded on the GPU in bfloat16, then quantized there."""
    source = resolve_model(path)
    config = config_from_hf(source.hf_config)
    model = build_model(config, load_state_dict(source, device=DEVICE, dtype=DTYPE))
    if mode is not None:
        quantize_model(model, mode, DEVICE, DTYPE)
    return model, config


def quantized_names(model) -> list[str]:
    return sorted(name for name, m in model.named_modules() if is_quantized(m))


@torch.inference_mode()
def logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids], device=DEVICE)).logits[0].float()


@torch.inference_mode()
def greedy(model, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids], device=DEVICE), attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                         device=DEVICE), do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, SHAPE["vocab_size"]) for _ in range(rng.randint(8, 60))] for _ in range(n)]


@pytest.mark.parametrize("mode", MODES)
def test_quantized_model_matches_transformers_on_cuda(saved, mode):
    model, config = ours(saved, mode)
    reference = theirs(saved, mode)
    assert quantized_names(model) == quantized_names(reference) and len(quantized_names(model)) == 7 * 4
    want = logits(reference, PROMPT)
    got = full_logits(model, config, PROMPT, DEVICE)
    diff = (got - want).abs().max().item()
    assert diff <= tolerance(want), f"{mode}: logits differ by {diff:.3g} (tolerance {tolerance(want):.3g})"

    unquantized, _ = ours(saved, None)
    assert weight_bytes(model) < weight_bytes(unquantized)
    if mode == "bitsandbytes-nf4":  # 4 bits move the logits well past bfloat16 noise; int8 barely does
        moved = (full_logits(unquantized, config, PROMPT, DEVICE) - got).abs().max().item()
        assert moved > diff, f"nf4 moves the logits by {moved:.3g}, no more than the parity difference {diff:.3g}"

    ps = prompts(6)
    engine = engine_for(model, config, device=DEVICE, dtype=DTYPE, max_batch_total_tokens=2048)
    tokens = [o.token_ids for o in engine.generate(ps, PARAMS)]
    expected = [greedy(reference, p) for p in ps]
    assert sum(t[0] == e[0] for t, e in zip(tokens, expected)) >= len(ps) // 2 + 1, (tokens, expected)


@pytest.mark.parametrize("mode", MODES)
def test_lora_on_quantized_model_matches_peft_on_cuda(saved, tmp_path, mode):
    model, config = ours(saved, mode)
    reference = theirs(saved, mode)
    trained = peft_model(reference, seed=3, r=16, lora_alpha=32, target_modules=list(ALL_PROJECTIONS))
    shapes = AdapterTable(model, 1, torch.device(DEVICE), DTYPE).base_shapes
    adapter = save_and_load(trained, tmp_path, "a", shapes)

    want = logits(trained, PROMPT)
    got = full_logits(model, config, PROMPT, DEVICE, adapter=adapter)
    diff = (got - want).abs().max().item()
    assert diff <= tolerance(want), f"{mode} + LoRA: logits differ from PEFT's by {diff:.3g}"
    effect = (want - logits(reference, PROMPT)).abs().max().item()
    assert effect > 4 * tolerance(want), f"the adapter moves PEFT's logits by only {effect:.3g}"

    ps = prompts(6)
    adapters = [adapter, None] * 3
    engine = engine_for(model, config, device=DEVICE, dtype=DTYPE, max_batch_total_tokens=4096, max_active_adapters=2)
    together = [o.token_ids for o in engine.generate(ps, PARAMS, adapters=adapters)]
    solo = [engine.generate([p], PARAMS, adapters=[a])[0].token_ids for p, a in zip(ps, adapters)]
    assert sum(t == s for t, s in zip(together, solo)) >= len(ps) - 2, (together, solo)
    expected = [greedy(trained if a is not None else reference, p) for p, a in zip(ps, adapters)]
    assert sum(s[0] == e[0] for s, e in zip(solo, expected)) >= len(ps) // 2 + 1, (solo, expected)


# ---- T5: its `wo` stays unquantized and float32 (transformers' _keep_in_fp32_modules) ----------------------


@pytest.fixture(scope="module")
def saved_t5(tmp_path_factory):
    config = transformers.T5Config(vocab_size=4096, d_model=512, d_kv=64, d_ff=1024, num_layers=3, num_heads=8,
                                   feed_forward_proj="gated-gelu", decoder_start_token_id=0)  # tied head, rescaled: logits of a sane size
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(config).eval()  # transformers' own initialisation
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("t5")
    hf.save_pretrained(path)
    return path


def ours_t5(path, mode: str):
    from loraplex.config import EngineConfig
    from loraplex.engine.loading import load_model

    loaded = load_model(EngineConfig(model_id=str(path), device=DEVICE, dtype="bfloat16", quantize=mode), log=lambda _: None)
    return loaded.model, loaded.config


@pytest.mark.parametrize("mode", MODES)
def test_quantized_t5_and_lora_match_transformers_and_peft_on_cuda(saved_t5, tmp_path, mode):
    from tests.helpers import encoder_decoder_logits

    model, config = ours_t5(saved_t5, mode)
    reference = transformers.T5ForConditionalGeneration.from_pretrained(
        saved_t5, quantization_config=bnb_config(mode), device_map=DEVICE, dtype=DTYPE).eval()
    names = quantized_names(model)
    assert names == quantized_names(reference) and names and not any(n.endswith(".wo") for n in names)
    assert model.decoder.block[0].layer[2].DenseReluDense.wo.weight.dtype == torch.float32
    encoder_ids, decoder_ids = PROMPT[1:] + [1], [0, 7, 99, 42, 18, 3, 250]
    enc, dec = torch.tensor([encoder_ids], device=DEVICE), torch.tensor([decoder_ids], device=DEVICE)
    with torch.inference_mode():
        want = reference(input_ids=enc, decoder_input_ids=dec).logits[0].float()
    got = encoder_decoder_logits(model, config, encoder_ids, decoder_ids, device=DEVICE)
    diff = (got - want).abs().max().item()
    assert diff <= tolerance(want), f"{mode}: T5 logits differ by {diff:.3g} (tolerance {tolerance(want):.3g})"

    trained = peft_model(reference, seed=3, r=16, lora_alpha=32, target_modules=["q", "k", "v", "o", "wi_0", "wi_1", "wo"])
    adapter = save_and_load(trained, tmp_path, "a", AdapterTable(model, 1, torch.device(DEVICE), DTYPE).base_shapes)
    with torch.inference_mode():
        want_lora = trained(input_ids=enc, decoder_input_ids=dec).logits[0].float()
    got_lora = encoder_decoder_logits(model, config, encoder_ids, decoder_ids, adapter=adapter, device=DEVICE)
    # PEFT keeps adapter weights in float32 (autocast_adapter_dtype) and computes deltas there; we compute them
    # in bfloat16, and T5's unscaled attention scores amplify the q/k deltas' rounding: a wider bound, and the
    # difference must stay well below what the adapter itself does.
    diff = (got_lora - want_lora).abs().max().item()
    effect = (want_lora - want).abs().max().item()
    assert diff <= 1e-1 * max(1.0, want_lora.abs().max().item()), f"{mode} + LoRA: T5 logits differ from PEFT's by {diff:.3g}"
    assert effect > 5 * diff and effect > 4 * tolerance(want), f"the adapter moves the logits by {effect:.3g}, diff {diff:.3g}"


@pytest.mark.parametrize("mode", MODES)
def test_load_model_never_holds_the_float_model_on_the_gpu(tmp_path, mode):
    """load_model(quantize=...) keeps the float weights in host memory and sends each linear quantized: the
    GPU's peak stays well under the bfloat16 model, and the model answers as one quantized after loading."""
    from loraplex.config import EngineConfig
    from loraplex.engine.loading import load_model

    shape = dict(SHAPE, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8)
    from tests.helpers import tiny_seq2seq_tokenizer

    hf = tiny_hf_model("llama", seed=1, **shape).to(DTYPE)
    hf.save_pretrained(tmp_path)
    tiny_seq2seq_tokenizer("bart").save_pretrained(tmp_path)  # load_model reads one (any will do here)
    float_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loaded = load_model(EngineConfig(model_id=str(tmp_path), device=DEVICE, dtype="bfloat16", quantize=mode),
                        log=lambda _: None)
    peak = torch.cuda.max_memory_allocated() - before
    assert peak < 0.7 * float_bytes, f"peak {peak / 2**20:.0f} MiB for a {float_bytes / 2**20:.0f} MiB bfloat16 model"
    assert all(p.device.type == "cuda" for p in loaded.model.parameters())
    model, config = ours(tmp_path, mode)  # loaded on the GPU in bfloat16, then quantized there
    got = full_logits(loaded.model, loaded.config, PROMPT, DEVICE)
    want = full_logits(model, config, PROMPT, DEVICE)
    assert (got - want).abs().max().item() <= tolerance(want)
