"""bitsandbytes' weights in our own layers (bnb/layers.py), as --quantize bitsandbytes | -nf4 | -fp4 runs them on
CUDA with Triton, checked here on the CPU through their reference path (the Triton kernels are checked on the GPU
by tests/gpu/test_gpu_quantization.py):

- the layers hold bitsandbytes' stored bits as they are (views, no copy) and dequantize to bitsandbytes' values;
- siblings fuse into one layer (q/k/v, gate/up) whose product equals the siblings' own;
- a whole model in these layers equals, in float32, transformers running the same weights dequantized, with and
  without a PEFT adapter on top, and a batch mixing adapters gives each request its solo tokens;
- layouts these layers cannot read (4-bit blocks that straddle rows) stay bitsandbytes' layers.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import loraplex.quantization.bnb.mode as bitsandbytes_mode
from loraplex.quantization import BITSANDBYTES_MODES, dequantized_weight, is_quantized, quantize_model, weight_bytes
from loraplex.quantization.bnb.layers import FourBitLinear, Int8Linear, from_bitsandbytes
from tests.helpers import engine_for, full_logits, ours_from_hf, tiny_hf_model
from tests.lora.peft_helpers import ALL_PROJECTIONS, peft_model, reference_greedy, reference_logits, save_and_load
from loraplex.params import SamplingParams

bnb = pytest.importorskip("bitsandbytes")
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

MODES = list(BITSANDBYTES_MODES)
OURS = {"bitsandbytes": Int8Linear, "bitsandbytes-nf4": FourBitLinear, "bitsandbytes-fp4": FourBitLinear}
PROMPT = [1, 17, 203, 45, 9, 88, 130, 7, 251, 64, 3, 99, 180, 42, 5, 77, 211, 8, 150, 33, 120]


def bnb_linear(mode: str, in_features: int = 256, out_features: int = 96, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) / 8)
        linear.bias.copy_(torch.randn(out_features, generator=gen))
    return bitsandbytes_mode.quantized_linear(bnb, linear, mode, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("mode", MODES)
def test_layers_hold_bitsandbytes_bits_and_dequantize_alike(mode):
    theirs = bnb_linear(mode)
    ours = from_bitsandbytes(theirs)
    assert type(ours) is OURS[mode]
    assert ours.weight.data_ptr() == theirs.weight.data_ptr()  # the stored bits themselves, not a copy
    want = bitsandbytes_mode.dequantized(theirs).float()
    if mode == "bitsandbytes":  # bitsandbytes multiplies by the row absmax, then by 1/127; we by their product
        torch.testing.assert_close(ours.dequantized(), want, rtol=1e-6, atol=0)
    else:
        assert torch.equal(ours.dequantized(), want)
    assert torch.equal(dequantized_weight(ours), ours.dequantized())
    assert ours(torch.empty(0, 256)).shape == (0, 96)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        layer_dtype_bias = ours.bias.to(dtype)
        expected = F.linear(x.to(dtype), ours.dequantized().to(dtype), layer_dtype_bias)
        ours.bias.data = layer_dtype_bias
        assert torch.equal(ours(x.to(dtype)), expected)
    packed_bytes = 256 * 96 if mode == "bitsandbytes" else 256 * 96 // 2
    assert packed_bytes < weight_bytes(nn.Sequential(ours)) < 256 * 96 * 2


@pytest.mark.parametrize("mode", MODES)
def test_siblings_fuse_into_one_product(mode):
    siblings = [from_bitsandbytes(bnb_linear(mode, out_features=n, seed=i)) for i, n in enumerate((64, 32, 32))]
    x = torch.randn(3, 256)
    alone = torch.cat([s(x) for s in siblings], dim=-1)
    fused = type(siblings[0]).fuse_siblings(siblings)
    assert fused is not None and fused.out_features == 128
    assert torch.equal(fused(x), alone)
    storage = fused.weight.untyped_storage().data_ptr()
    assert all(s.weight.untyped_storage().data_ptr() == storage for s in siblings)  # views of the fused tensors
    assert torch.equal(torch.cat([s(x) for s in siblings], dim=-1), alone)


def test_unlike_siblings_do_not_fuse():
    nf4, fp4, int8 = (from_bitsandbytes(bnb_linear(m)) for m in ("bitsandbytes-nf4", "bitsandbytes-fp4", "bitsandbytes"))
    assert FourBitLinear.fuse_siblings([nf4, fp4]) is None  # different code books
    assert FourBitLinear.fuse_siblings([nf4, int8]) is None
    narrower = from_bitsandbytes(bnb_linear("bitsandbytes", in_features=128))
    assert Int8Linear.fuse_siblings([int8, narrower]) is None


def test_four_bit_blocks_across_rows_stay_bitsandbytes(monkeypatch):
    assert from_bitsandbytes(bnb_linear("bitsandbytes-nf4", in_features=96, out_features=32)) is None
    monkeypatch.setattr(bitsandbytes_mode, "_own_kernels", lambda device, dtype: True)
    model = nn.Sequential(nn.Linear(96, 32), nn.Linear(64, 64)).eval()  # only the second is whole blocks of 64
    quantize_model(model, "bitsandbytes-nf4", "cpu", torch.float32, skip=lambda name: False)
    assert bitsandbytes_mode.is_bitsandbytes_linear(model[0]) and type(model[1]) is FourBitLinear


@pytest.fixture(scope="module")
def hf_llama():
    hf = tiny_hf_model("llama", seed=0)  # hidden 64, intermediate 128: every input width is whole 4-bit blocks
    with torch.no_grad():  # larger weights: 4-bit and 8-bit rounding then moves the logits well past float32 noise
        for layer in hf.model.layers:
            layer.input_layernorm.weight[[3, 40]] *= 12
    return hf


@pytest.mark.parametrize("mode", MODES)
def test_model_in_our_layers_equals_transformers_on_the_dequantized_weights(hf_llama, tmp_path, monkeypatch, mode):
    monkeypatch.setattr(bitsandbytes_mode, "_own_kernels", lambda device, dtype: True)  # what CUDA + Triton choose
    ours, config = ours_from_hf(hf_llama)
    quantize_model(ours, mode, "cpu", torch.float32)
    quantized = {name: m for name, m in ours.named_modules() if is_quantized(m)}
    assert len(quantized) == 7 * 2 and all(type(m) is OURS[mode] for m in quantized.values())
    reference = tiny_hf_model("llama", seed=0)
    reference.load_state_dict(hf_llama.state_dict())
    with torch.no_grad():
        for name, layer in quantized.items():
            reference.get_submodule(name).weight.copy_(layer.dequantized())
    want = reference_logits(reference, PROMPT)
    moved = (want - reference_logits(hf_llama, PROMPT)).abs().max().item()
    tolerance = 1e-4 * max(1.0, want.abs().max().item())
    torch.testing.assert_close(full_logits(ours, config, PROMPT), want, atol=tolerance, rtol=0)
    assert moved > 20 * tolerance, f"{mode} moves the logits by only {moved:.2g}: the comparison would not bite"

    trained = peft_model(reference, seed=3, r=8, lora_alpha=16, target_modules=list(ALL_PROJECTIONS))
    engine = engine_for(ours, config, max_batch_total_tokens=1024, max_active_adapters=2)
    assert all(type(engine.lora.layers[m].base) is OURS[mode] for m in quantized)  # LoRA on our layers
    adapter = save_and_load(trained, tmp_path, "a", engine.lora.base_shapes)
    lora_want = reference_logits(trained, PROMPT)
    torch.testing.assert_close(full_logits(ours, config, PROMPT, adapter=adapter), lora_want,
                               atol=1e-4 * max(1.0, lora_want.abs().max().item()), rtol=0)
    assert (lora_want - want).abs().max() > 20 * tolerance, "the adapter barely matters"

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(4, 24))] for _ in range(4)]
    adapters = [adapter, None, adapter, None]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    together = [o.token_ids for o in engine.generate(prompts, params, adapters=adapters)]
    solo = [engine.generate([p], params, adapters=[a])[0].token_ids for p, a in zip(prompts, adapters)]
    assert together == solo
    assert solo[:2] == [reference_greedy(trained, prompts[0], 8), reference_greedy(reference, prompts[1], 8)]
