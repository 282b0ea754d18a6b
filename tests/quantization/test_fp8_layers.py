"""FP8 layers on the CPU (the emulated product, which is the reference of the GPU's `torch._scaled_mm`):

- Fp8Linear equals a fake-quantized float reference (x rounded to e4m3 with its row's scale, times the dequantized
  weight) to 1e-5 relative (float32 rounding), and the float layer it came from to 8% of the output's size (e4m3's
  3 mantissa bits: each input and weight value moves by up to 1/16);
- per-tensor scales expand to every channel; static input scales are used as they are; zero rows stay zeros;
- the block layer equals its dequantized weight's product exactly;
- q/k/v and gate/up siblings fuse into one Fp8Linear (views of its tensors), with the LoRA wrapper around;
- `check` and the detection of published configs refuse what is not served with one line.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loraplex.layers.projections import fuse_projections, project
from loraplex.quantization import QuantizationError, check_quantize, dequantized_weight, is_quantized
from loraplex.quantization.checkpoint_format import checkpoint_format
from loraplex.quantization.fp8.mode import quantize_linear
from loraplex.quantization.fp8.layers import Fp8BlockLinear, Fp8Linear
from loraplex.quantization.fp8.numerics import FP8, FP8_MAX, quantize_rows_torch

GEN = torch.Generator().manual_seed(0)


def fake_quantized_rows(x: torch.Tensor, static: float | None = None) -> torch.Tensor:
    """x rounded to e4m3 with each row's absmax / 448 scale (or one static scale), back in float32."""
    scale = x.abs().amax(-1, keepdim=True) / FP8_MAX if static is None else torch.tensor(static)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def float_linear(inputs: int = 64, outputs: int = 48, bias: bool = True) -> nn.Linear:
    linear = nn.Linear(inputs, outputs, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(outputs, inputs, generator=GEN) / 8)
        if bias:
            linear.bias.copy_(torch.randn(outputs, generator=GEN))
    return linear.requires_grad_(False)


def test_emulated_product_equals_the_fake_quantized_reference_and_is_close_to_float():
    linear = float_linear()
    layer = quantize_linear(linear, "cpu", torch.float32)
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (48,) and is_quantized(layer)
    x = torch.randn(2, 5, 64, generator=GEN) * 3
    got = layer(x)
    want = fake_quantized_rows(x) @ layer.dequantized().t() + linear.bias
    assert got.shape == (2, 5, 48) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)
    exact = linear(x)
    assert (got - exact).abs().max() < 0.08 * exact.abs().max()
    torch.testing.assert_close(dequantized_weight(layer), linear.weight, atol=linear.weight.abs().max() / 16, rtol=0)
    assert layer(torch.zeros(3, 64)).eq(linear.bias).all()  # a zero row: scale clamped, no NaN


def test_bfloat16_output_and_static_and_per_tensor_scales():
    linear = float_linear(bias=False)
    weight = (linear.weight / 0.01).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    layer = Fp8Linear(weight, torch.tensor([0.01]), input_scale=torch.tensor([0.05]))
    assert layer.weight_scale.shape == (48,) and layer.weight_scale.eq(0.01).all()
    x = torch.randn(4, 64, generator=GEN)
    want = fake_quantized_rows(x, 0.05) @ (weight.float() * 0.01).t()
    torch.testing.assert_close(layer(x), want, atol=1e-5 * want.abs().max().item(), rtol=0)
    out = layer(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, atol=2e-2 * want.abs().max().item(), rtol=0)


def test_row_quantization_saturates_and_keeps_the_scale():
    rows = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    q, scale = quantize_rows_torch(rows, None)
    assert q.dtype == FP8 and scale.shape == (2, 1) and scale[0, 0] == 2.0 / FP8_MAX and scale[1, 0] > 0
    assert q[0].float().tolist() == [224.0, -448.0, 112.0] and q[1].float().eq(0).all()
    q, scale = quantize_rows_torch(rows, torch.tensor(0.001))  # static: 2.0 / 0.001 saturates at 448
    assert q[0].float().tolist() == [448.0, -448.0, 448.0] and scale.eq(0.001).all()


def test_block_layer_is_exact_against_its_dequantized_weight():
    weight = (torch.randn(48, 80, generator=GEN) * 40).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    scales = torch.rand(2, 3, generator=GEN) + 0.5  # blocks of 32 x 32: the last row and column blocks partial
    layer = Fp8BlockLinear(weight, scales, (32, 32))
    deq = layer.dequantized()
    assert deq[31, 31] == weight[31, 31].float() * scales[0, 0] and deq[47, 79] == weight[47, 79].float() * scales[1, 2]
    x = torch.randn(3, 80, generator=GEN)
    torch.testing.assert_close(layer(x), x @ deq.t(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="blocks"):
        Fp8BlockLinear(weight, scales[:, :2], (32, 32))


class Siblings(nn.Module):
    SIBLINGS = (("q", "k", "v"),)

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q, self.k, self.v = (quantize_linear(float_linear(64, n, bias), "cpu", torch.float32) for n in (64, 32, 32))


@pytest.mark.parametrize("bias", [False, True])
def test_quantized_siblings_fuse_into_one_product(bias):
    from loraplex.lora.step.layers import wrap_linears

    owner = Siblings(bias)
    x = torch.randn(5, 64, generator=GEN)
    alone = [getattr(owner, n)(x) for n in "qkv"]
    wrap_linears(owner)  # the LoRA wrappers around: `project` hands them the fused product
    assert fuse_projections(owner) == 1
    fused = owner.fused_projections[("q", "k", "v")]
    assert isinstance(fused.layer, Fp8Linear) and fused.sizes == (64, 32, 32)
    assert owner.q.base.weight.data_ptr() == fused.layer.weight.data_ptr()  # views, no second copy
    assert owner.v.base.weight_scale.data_ptr() == fused.layer.weight_scale[96:].data_ptr()
    for got, want in zip(project(owner, x, ("q", "k", "v")), alone):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # per-row scales: the same product, fused or not


def test_siblings_with_and_without_static_input_scales_stay_apart():
    owner = Siblings(False)
    owner.k = Fp8Linear(owner.k.weight, owner.k.weight_scale, input_scale=torch.tensor(0.1))
    assert fuse_projections(owner) == 0 and owner.fused_projections == {}


# ---- refusals ---------------------------------------------------------------------------------------------


def test_check_allows_the_cpu_and_refuses_other_devices():
    check_quantize("fp8", "cpu", torch.float32)
    with pytest.raises(QuantizationError, match="runs on CUDA FP8 GPUs"):
        check_quantize("fp8", "meta", torch.bfloat16)


def test_check_refuses_a_gpu_without_fp8(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(QuantizationError) as error:
        check_quantize("fp8", "cuda", torch.bfloat16)
    assert str(error.value) == ("--quantize fp8 needs an FP8 GPU (Ada/Hopper, compute capability 8.9+); "
                                "NVIDIA A100-SXM4-80GB is 8.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(QuantizationError, match="bfloat16 or float16, not float32"):
        check_quantize("fp8", "cuda", torch.float32)


def ct_config(weights="channel", inputs=("token", True), fmt="float-quantized", **extra) -> dict:
    strategy, dynamic = inputs
    group = {"format": fmt, "targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "float", "strategy": weights, "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": dynamic}}
    if weights == "block":
        group["weights"]["block_structure"] = [128, 128]
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt,
                                    "config_groups": {"group_0": group}, **extra}}


def test_published_configs_are_detected():
    assert checkpoint_format(ct_config()).marker == "weight_scale"
    static = checkpoint_format(ct_config("tensor", ("tensor", False)))
    assert static.suffixes == ("weight", "weight_scale", "input_scale") and "static" in static.name
    assert "blocks of 128x128" in checkpoint_format(ct_config("block", ("group", True))).name
    kv = checkpoint_format(ct_config(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}))
    assert kv.extras["kv_cache_scheme"]["num_bits"] == 8 and any("k" in p for p in kv.ignored)
    block = checkpoint_format({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                       "weight_block_size": [128, 128]}})
    assert block.marker == "weight_scale_inv" and block.suffixes == ("weight", "weight_scale_inv")
    per_tensor = checkpoint_format({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                                            "weight_block_size": None}})
    assert per_tensor.suffixes == ("weight", "weight_scale_inv", "activation_scale")
    autofp8 = checkpoint_format({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})
    assert autofp8.suffixes == ("weight", "weight_scale", "input_scale")


@pytest.mark.parametrize("config, message", [
    (ct_config(inputs=("tensor", True)), "input activations dynamic per 'tensor'"),
    (ct_config("group"), "weight strategy 'group'"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}},
     "weight blocks and static"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "sometimes"}}, "activation_scheme"),
])
def test_unserved_fp8_configs_are_refused_in_one_line(config, message):
    with pytest.raises(QuantizationError, match=message) as error:
        checkpoint_format(config)
    assert "\n" not in str(error.value)


def test_a_config_mixing_formats_is_refused():
    config = ct_config()
    groups = config["quantization_config"]["config_groups"]
    groups["group_1"] = {**groups["group_0"], "format": "pack-quantized"}
    with pytest.raises(QuantizationError, match="mixing formats"):
        checkpoint_format(config)
