"""FP8 on CUDA (`python -m pytest tests/gpu/test_gpu_fp8.py`, an FP8 GPU: Ada or Hopper):

- the Triton activation quantizer gives the torch ops' scales and e4m3 rows (a division may round one ulp apart:
  at most one e4m3 step on under 1% of the values);
- Fp8Linear's `torch._scaled_mm` product equals the emulated one (the reference, fp8/numerics.py) to bfloat16
  rounding, with per-token and static input scales, fused siblings included;
- `--quantize fp8` through load_model on a small Llama (hidden 512, 4 layers) in bfloat16: logits close to the
  emulated product's (the same model with `_scaled_mm` off), q/k/v and gate/up fused into one FP8 product each,
  decode steps replayed as CUDA graphs; a batch mixing adapter and base requests gives each its solo tokens;
  LoRA on top close to PEFT over the same e4m3 weights and inputs (tests/quantization/test_fp8_checkpoints.py's
  reference).
"""

import copy
import random

import pytest
import torch

from loraplex.config import EngineConfig
from loraplex.engine.loading import load_model
from loraplex.lora.device.table import AdapterTable
from loraplex.quantization import weight_only
from loraplex.quantization.fp8 import numerics
from loraplex.quantization.fp8.mode import quantize_linear
from loraplex.quantization.fp8.layers import Fp8Linear
from loraplex.quantization.split_k import split_counters
from tests.gpu.quantized_llama import DEVICE, DTYPE, PARAMS, SHAPE, assert_batch_matches_solo, tolerance
from tests.helpers import engine_for, full_logits, tiny_hf_model
from tests.lora.peft_helpers import ALL_PROJECTIONS, peft_model, save_and_load

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 needs compute capability 8.9+", allow_module_level=True)

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

# The prompt inside this file's trained tokenizer's vocabulary (400 ids).
PROMPT = [1, 17, 203, 45, 9, 88, 130, 7, 251, 64, 3, 99, 180, 42, 5, 77, 211, 8, 150, 33, 120, 248, 390, 371]


def float_linear(inputs: int, outputs: int, bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(inputs + outputs)
    linear = torch.nn.Linear(inputs, outputs, bias=bias, device=DEVICE, dtype=DTYPE)
    with torch.no_grad():
        linear.weight.normal_(0, inputs ** -0.5)
    return linear


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_triton_activation_quantizer_matches_torch(rows, static):
    from loraplex.quantization.fp8.kernels import quantize_rows

    x = torch.randn(rows, 4096, device=DEVICE, dtype=DTYPE) * 3
    if rows > 1:
        x[-1] = 0  # an all-zero row: its scale is clamped, its values stay zeros
    scale = torch.tensor(0.01, device=DEVICE) if static else None
    q, s = quantize_rows(x, scale)
    want_q, want_s = numerics.quantize_rows_torch(x, scale)
    assert q.dtype == numerics.FP8 and s.shape == (rows, 1) and q.is_contiguous()
    torch.testing.assert_close(s, want_s, rtol=1e-6, atol=0)
    differ = q.float() != want_q.float()
    assert differ.float().mean() < 0.01
    assert ((q.float() - want_q.float()).abs() <= want_q.float().abs() / 8 + 2 ** -9)[differ].all()
    assert torch.isfinite(q.float()).all()


def test_padded_rows_are_zeros_and_leave_the_product_alone():
    from loraplex.quantization.fp8.kernels import quantize_rows

    x = torch.randn(3, 1024, device=DEVICE, dtype=DTYPE)
    q, s = quantize_rows(x, None, min_rows=17)
    assert q.shape == (17, 1024) and s.shape == (17, 1) and q[3:].float().eq(0).all()
    torch.testing.assert_close(q[:3].float(), quantize_rows(x, None)[0].float(), rtol=0, atol=0)
    layer = quantize_linear(float_linear(1024, 768), DEVICE, DTYPE)
    unpadded = layer(x)
    layer.min_rows = 17
    padded = layer(x)
    assert padded.shape == (3, 768)
    torch.testing.assert_close(padded.float(), unpadded.float(), atol=1e-2 * unpadded.abs().max().item(), rtol=0)


@pytest.mark.parametrize("in_kernel", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_decode_rows_take_the_weight_only_kernel(monkeypatch, rows, bias, in_kernel):
    """Up to 16 rows read the e4m3 weight directly (weight_only, its "rows" kernel for one row, "dot" for more; the
    split partials added by a second launch or in the kernel): x unquantized times the dequantized weight."""
    monkeypatch.setattr(weight_only, "IN_KERNEL_REDUCE", in_kernel)
    layer = quantize_linear(float_linear(1024, 768, bias=bias), DEVICE, DTYPE)
    x = torch.randn(rows, 1024, device=DEVICE, dtype=DTYPE)
    want = x.float() @ layer.dequantized().t() + (layer.bias.float() if bias else 0)
    counters = split_counters(torch.device(DEVICE))
    got = weight_only.matmul(x, layer.weight, layer.weight_scale, layer.bias, counters)
    assert torch.equal(layer(x), got) and int(counters.abs().sum()) == 0
    assert all(torch.equal(weight_only.matmul(x, layer.weight, layer.weight_scale, layer.bias, counters), got)
               for _ in range(20)), "split partials are added in one order"
    assert got.dtype == DTYPE
    torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(), rtol=0)
    layer.weight_only_decode = False
    assert not torch.equal(layer(x), got)  # the other path, quantized activations, rounds otherwise


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_scaled_mm_equals_the_emulated_product(rows, static):
    layer = quantize_linear(float_linear(1024, 768, bias=True), DEVICE, DTYPE)
    layer.weight_only_decode = False  # every row count through _scaled_mm (the decode kernel: the test below)
    if static:
        layer.input_scale = torch.nn.Parameter(torch.tensor(0.02, device=DEVICE), requires_grad=False)
    assert numerics.scaled_mm_usable(layer.weight.device, 1024, 768) and layer.activation_quant == "triton"
    x = torch.randn(rows, 1024, device=DEVICE, dtype=DTYPE)
    got = layer(x)
    q, q_scale = numerics.quantize_rows_torch(x, layer.input_scale)
    want = numerics.emulated_scaled_mm(q, q_scale, layer.weight, layer.weight_scale, torch.float32) + layer.bias.float()
    assert got.dtype == DTYPE and got.shape == (rows, 768)
    torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=0)


def test_fused_siblings_on_cuda_equal_each_alone():
    siblings = [quantize_linear(float_linear(512, n), DEVICE, DTYPE) for n in (512, 128, 128)]
    x = torch.randn(5, 512, device=DEVICE, dtype=DTYPE)
    alone = [s(x) for s in siblings]
    fused = Fp8Linear.fuse_siblings(siblings)
    for got, want in zip(fused(x).split((512, 128, 128), dim=-1), alone):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # per-row and per-channel scales: nothing shared


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from tests.helpers import tiny_seq2seq_tokenizer

    # A tokenizer trained here (the embedded model's needs its package, which the GPU machine lacks), as large as
    # the vocabulary.
    tokenizer = tiny_seq2seq_tokenizer("bart")
    hf = tiny_hf_model("llama", seed=0, **{**SHAPE, "vocab_size": len(tokenizer)})
    path = tmp_path_factory.mktemp("llama")
    tokenizer.save_pretrained(path)
    hf.save_pretrained(path)
    return hf, path


def ours(path):
    loaded = load_model(EngineConfig(model_id=str(path), device=DEVICE, dtype="bfloat16", quantize="fp8"),
                        log=lambda _: None)
    return loaded.model, loaded.config


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 300) for _ in range(rng.randint(8, 60))] for _ in range(n)]


def test_quantize_fp8_on_cuda_under_graphs_with_adapters(saved, tmp_path, monkeypatch):
    from tests.quantization.test_fp8_checkpoints import with_fp8_inputs

    hf, path = saved
    model, config = ours(path)
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 7 * SHAPE["num_hidden_layers"]
    # The model against its references through _scaled_mm (quantized activations) alone: decode rows would take the
    # weight-only kernel, which rounds otherwise (its own test: test_decode_rows_take_the_weight_only_kernel).
    for layer in layers:
        layer.weight_only_decode = False
    got = full_logits(model, config, PROMPT, DEVICE)
    with monkeypatch.context() as patched:  # the same model, its products emulated
        patched.setattr(numerics, "scaled_mm_usable", lambda *args: False)
        emulated = full_logits(model, config, PROMPT, DEVICE)
    # Twice bfloat16's tolerance: cuBLASLt and the emulation sum in different orders, and the four layers' activations
    # are re-quantized to e4m3 after each, where one rounding flip moves a value by a whole e4m3 step (measured on the
    # H200: 1.008x the single tolerance on this prompt).
    assert (got - emulated).abs().max() <= 2 * tolerance(emulated)

    reference = copy.deepcopy(hf).to(DEVICE, DTYPE)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Fp8Linear):
                reference.get_submodule(name).weight.copy_(module.dequantized())
    reference = with_fp8_inputs(reference)
    trained = peft_model(reference, seed=3, r=16, lora_alpha=32, target_modules=list(ALL_PROJECTIONS))
    shapes = AdapterTable(model, 1, torch.device(DEVICE), DTYPE).base_shapes
    adapter = save_and_load(trained, tmp_path, "a", shapes)
    with torch.inference_mode():
        want = trained(torch.tensor([PROMPT], device=DEVICE)).logits[0].float()
    with_lora = full_logits(model, config, PROMPT, DEVICE, adapter=adapter)
    assert (with_lora - want).abs().max() <= tolerance(want), "LoRA on FP8 differs from PEFT"
    assert (with_lora - got).abs().max() > 4 * tolerance(want), "the adapter barely matters"

    for layer in layers:  # served as it is served: decode rows through the weight-only kernel
        layer.weight_only_decode = True
    engine = engine_for(model, config, device=DEVICE, dtype=DTYPE, max_batch_total_tokens=4096, max_active_adapters=2)
    fused = model.model.layers[0].self_attn.fused_projections[("q_proj", "k_proj", "v_proj")]
    assert isinstance(fused.layer, Fp8Linear)  # the runner fused the FP8 siblings
    ps = prompts(6)
    # Where a request's tokens alone part from its tokens in the batch, it is at a near tie: the batch's and the
    # lone request's products sum in other orders (other kernels for other row counts), and the next layer
    # re-quantizes its activations to e4m3, where one rounding flip moves a value a whole e4m3 step (6%); this
    # random model's top two tokens are often within 0.01 nats of each other.
    equal = assert_batch_matches_solo(engine, ps, PARAMS, [adapter, None] * 3, near_tie=0.1)
    assert equal >= len(ps), "hardly a token compared"
    assert engine.runner.decode_graphs.num_captured >= 1
