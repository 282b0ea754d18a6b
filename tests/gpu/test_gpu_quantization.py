"""--quantize on CUDA (`python -m pytest tests/gpu`): bitsandbytes 8-bit and nf4 on a small Llama (4 layers,
hidden 512, GQA, a few outlier feature channels as trained models have) in bfloat16. On CUDA bitsandbytes'
weights run in our own layers (bnb/layers.py: weight_only's Triton kernels for up to 64 rows), so:

- the kernels, for every row count and both split reductions, equal x times the dequantized weight, in CUDA
  graphs too; the 4-bit dequantization is bitsandbytes' own, bit for bit;
- the same linears quantized as transformers quantizes them with the same BitsAndBytesConfig; nf4 logits close
  to transformers' (bfloat16 tolerance); int8 logits close to the float model on the same int8 weights (our int8
  product is weight-only) and closer to the float model than transformers' LLM.int8 is;
- LoRA on top equals PEFT on the same reference (logits close, first tokens identical);
- a batch mixing adapter and base requests gives each request its solo tokens up to a near tie: the kernels for
  other row counts sum in other orders, so bfloat16 ties may break differently (the CPU suite checks exactness).
"""

import random

import pytest
import torch

from loraplex.checkpoints.sources import resolve_model
from loraplex.checkpoints.weights import load_state_dict
from loraplex.engine.loading import build_model
from loraplex.models.registry import config_from_hf
from loraplex.lora.device.table import AdapterTable
from loraplex.quantization import is_quantized, quantize_model, weight_bytes
from loraplex.quantization.bnb import mode as bitsandbytes_mode
from loraplex.quantization import weight_only
from loraplex.quantization.bnb.layers import FourBitLinear, Int8Linear, from_bitsandbytes
from tests.gpu.quantized_llama import DEVICE, DTYPE, NEW, PARAMS, PROMPT, SHAPE, assert_batch_matches_solo, tolerance
from tests.helpers import engine_for, full_logits, tiny_hf_model
from tests.lora.peft_helpers import ALL_PROJECTIONS, peft_model, save_and_load

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

transformers = pytest.importorskip("transformers")
bnb = pytest.importorskip("bitsandbytes")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

MODES = ["bitsandbytes", "bitsandbytes-nf4"]
OURS = {"bitsandbytes": Int8Linear, "bitsandbytes-nf4": FourBitLinear, "bitsandbytes-fp4": FourBitLinear}


def float_linear(k: int, n: int, seed: int = 0) -> torch.nn.Linear:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    linear = torch.nn.Linear(k, n, device=DEVICE, dtype=DTYPE).requires_grad_(False)
    linear.weight.copy_(torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5)
    linear.bias.copy_(torch.randn(n, generator=gen, device=DEVICE))
    return linear


@pytest.mark.parametrize("in_kernel", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 64, 100])
@pytest.mark.parametrize("mode", list(OURS))
def test_our_layers_multiply_by_the_dequantized_weight(monkeypatch, mode, rows, in_kernel):
    """int8: up to 64 rows take weight_only's kernels ("rows" for one row, "dot" for more; split partials added
    by a second launch or in the kernel), more dequantize and multiply; 4-bit: bitsandbytes' gemv for one row, its
    dequantization and a bfloat16 product for more. x times the dequantized weight, the same every call and when
    replayed from a CUDA graph."""
    monkeypatch.setattr(weight_only, "IN_KERNEL_REDUCE", in_kernel)
    layer = bitsandbytes_mode.quantized_linear(bnb, float_linear(2048, 768), mode, torch.device(DEVICE), DTYPE)
    assert type(layer) is OURS[mode]
    x = torch.randn(rows, 2048, device=DEVICE, dtype=DTYPE)
    with torch.inference_mode():
        got = layer(x)
        assert got.dtype == DTYPE and all(torch.equal(layer(x), got) for _ in range(10))
        weight = layer.dequantized() if mode == "bitsandbytes" else layer.dequantized_as(DTYPE).float()
        want = x.float() @ weight.t() + layer.bias.float()
        torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(), rtol=0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer(x)
        graph.replay()
        assert torch.equal(captured, got)


@pytest.mark.parametrize("mode", ["bitsandbytes-nf4", "bitsandbytes-fp4"])
def test_four_bit_dequantization_is_bitsandbytes_own(monkeypatch, mode):
    monkeypatch.setattr(bitsandbytes_mode, "_own_kernels", lambda device, dtype: False)
    theirs = bitsandbytes_mode.quantized_linear(bnb, float_linear(4096, 1024), mode, torch.device(DEVICE), DTYPE)
    ours = from_bitsandbytes(theirs)
    assert ours.weight.data_ptr() == theirs.weight.data_ptr()
    want = bnb.functional.dequantize_4bit(theirs.weight.data, theirs.weight.quant_state)
    assert want.dtype == DTYPE and torch.equal(ours.dequantized_as(DTYPE), want)
    assert torch.equal(ours.dequantized().to(DTYPE), want)


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


def theirs(path, mode: str | None, cls=None):
    """transformers' model of the checkpoint, quantized with `mode`'s BitsAndBytesConfig (None: the float model)."""
    cls = cls or transformers.AutoModelForCausalLM
    quantization = {} if mode is None else {"quantization_config": bnb_config(mode)}
    return cls.from_pretrained(path, device_map=DEVICE, dtype=DTYPE, attn_implementation="eager", **quantization).eval()


def reference_for(path, mode: str, model, cls=None):
    """What our quantized `model` computes, in transformers: for nf4 transformers' own quantization (its weights
    are ours, bit for bit); for int8 the float model on our int8 weights dequantized (our product is weight-only,
    LLM.int8's quantizes the activations too)."""
    if mode != "bitsandbytes":
        return theirs(path, mode, cls)
    reference = theirs(path, None, cls)
    with torch.no_grad():
        for name, module in model.named_modules():
            if is_quantized(module):
                reference.get_submodule(name.removesuffix(".base")).weight.copy_(module.dequantized())
    return reference


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
    transformers_quantized = theirs(saved, mode)
    assert quantized_names(model) == quantized_names(transformers_quantized) and len(quantized_names(model)) == 7 * 4
    assert all(type(m) is OURS[mode] for m in model.modules() if is_quantized(m))
    reference = reference_for(saved, mode, model)
    want = logits(reference, PROMPT)
    got = full_logits(model, config, PROMPT, DEVICE)
    diff = (got - want).abs().max().item()
    assert diff <= tolerance(want), f"{mode}: logits differ by {diff:.3g} (tolerance {tolerance(want):.3g})"

    unquantized, _ = ours(saved, None)
    assert weight_bytes(model) < weight_bytes(unquantized)
    float_logits = full_logits(unquantized, config, PROMPT, DEVICE)
    if mode == "bitsandbytes-nf4":  # 4 bits move the logits well past bfloat16 noise; int8 barely does
        moved = (float_logits - got).abs().max().item()
        assert moved > diff, f"nf4 moves the logits by {moved:.3g}, no more than the parity difference {diff:.3g}"
    else:  # weight-only int8 is closer to the float model than LLM.int8 (which quantizes activations too)
        ours_error = (got - float_logits).abs().max().item()
        llm_int8_error = (logits(transformers_quantized, PROMPT) - float_logits).abs().max().item()
        assert ours_error < llm_int8_error, f"int8 off the float model by {ours_error:.3g}, LLM.int8 {llm_int8_error:.3g}"

    ps = prompts(6)
    engine = engine_for(model, config, device=DEVICE, dtype=DTYPE, max_batch_total_tokens=2048)
    tokens = [o.token_ids for o in engine.generate(ps, PARAMS)]
    expected = [greedy(reference, p) for p in ps]
    assert sum(t[0] == e[0] for t, e in zip(tokens, expected)) >= len(ps) // 2 + 1, (tokens, expected)


@pytest.mark.parametrize("mode", MODES)
def test_lora_on_quantized_model_matches_peft_on_cuda(saved, tmp_path, mode):
    model, config = ours(saved, mode)
    reference = reference_for(saved, mode, model)
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
    # One nf4 row takes bitsandbytes' gemv, a batch its dequantization and a bfloat16 product; int8 rows take
    # kernels of other shapes: where a request's batch and solo tokens part, it is at a near tie.
    equal = assert_batch_matches_solo(engine, ps, PARAMS, adapters, near_tie=0.1)
    assert equal >= len(ps) * 2, f"only {equal} tokens agree before the batch and solo runs part"
    solo = [engine.generate([p], PARAMS, adapters=[a])[0].token_ids for p, a in zip(ps, adapters)]
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
    t5 = transformers.T5ForConditionalGeneration
    names = quantized_names(model)
    assert names == quantized_names(theirs(saved_t5, mode, t5)) and names and not any(n.endswith(".wo") for n in names)
    reference = reference_for(saved_t5, mode, model, t5)
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
