"""--quantize fp8 beyond Llama, on the CPU's emulated product: MPT (ALiBi, fused Wqkv) with LoRA against PEFT, and
T5 (encoder-decoder; its `wo` kept in float) against the float model whose FP8 linears read e4m3-rounded inputs."""

from __future__ import annotations

import copy

import torch
from torch import nn

from loraplex.quantization import quantize_model
from loraplex.quantization.fp8.layers import Fp8Linear
from loraplex.quantization.fp8.numerics import FP8, FP8_MAX
from tests.helpers import encoder_decoder_logits, full_logits, load_ours, tiny_mpt, tiny_t5
from tests.lora.peft_helpers import peft_model, reference_logits, save_and_load
from tests.quantization.test_bnb_cpu import PROMPT, atol
from loraplex.lora.device.table import AdapterTable


def fp8_model(hf, path):
    """Ours from `hf` (saved in `path`, loaded as load_model does), --quantize fp8, and `hf`'s copy with those linears' dequantized weights, reading their inputs
    rounded to e4m3 as the FP8 product does (per-token absmax / 448)."""
    ours, config = load_ours(hf, path)
    quantize_model(ours, "fp8", "cpu", torch.float32)
    reference = copy.deepcopy(hf)
    names = [n for n, m in ours.named_modules() if isinstance(m, Fp8Linear)]
    assert names
    with torch.no_grad():
        for name in names:
            linear = reference.get_submodule(name)
            linear.weight.copy_(ours.get_submodule(name).dequantized())
            linear.register_forward_pre_hook(_rounded_input)
    return ours, config, reference, names


def _rounded_input(_, args):
    x = args[0].float()
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return ((x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).to(args[0].dtype),


def test_mpt_on_fp8_with_lora_matches_peft(tmp_path):
    ours, config, reference, _ = fp8_model(tiny_mpt(seed=1), tmp_path / "mpt")
    trained = peft_model(reference, seed=2, r=8, lora_alpha=16, target_modules=["Wqkv", "out_proj", "up_proj", "down_proj"])
    shapes = AdapterTable(ours, 1, torch.device("cpu"), torch.float32).base_shapes
    adapter = save_and_load(trained, tmp_path, "a", shapes, base_weight=lambda m: ours.get_submodule(m).dequantized())
    base = reference_logits(reference, PROMPT)
    torch.testing.assert_close(full_logits(ours, config, PROMPT), base, atol=atol(base), rtol=0)
    # With the adapter on every linear the logits differ by ~1e-3 at every later position, as one activation rounded
    # to the neighbouring e4m3 value on one side would make them (the two sides' float32 paths differ in order);
    # each module's adapter alone matches to 1e-6.
    want = reference_logits(trained, PROMPT)
    torch.testing.assert_close(full_logits(ours, config, PROMPT, adapter=adapter), want, atol=atol(want, 3e-3), rtol=0)
    assert (want - base).abs().max() > 10 * atol(want, 3e-3), "the adapter barely matters"


def test_t5_on_fp8_keeps_wo_and_matches_the_rounded_float_model(tmp_path):
    hf = tiny_t5(gated=True, seed=0)
    ours, config, reference, names = fp8_model(hf, tmp_path)
    assert not any(n.endswith(".wo") for n in names)  # transformers' _keep_in_fp32_modules: kept in float
    assert all(type(m) is nn.Linear for n, m in ours.named_modules() if n.endswith(".wo"))
    encoder_ids, decoder_ids = [5, 17, 99, 42, 8, 150, 33, 2], [0, 12, 77, 140, 9]
    with torch.inference_mode():
        want = reference(input_ids=torch.tensor([encoder_ids]), decoder_input_ids=torch.tensor([decoder_ids])).logits[0]
    got = encoder_decoder_logits(ours, config, encoder_ids, decoder_ids)
    torch.testing.assert_close(got, want.float(), atol=atol(want), rtol=0)
