"""4-bit weight-only checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) on the CPU: a tiny Llama's linears
quantized and packed by the tests' own packers (w4a16_checkpoints: GPTQ and AWQ from their published layouts,
compressed-tensors by its own pack_to_int32), read by our loader, against transformers running the float model whose
weights are the dequantized ones:

- every quantized linear's dequantized() equals the written weight exactly, in the original feature order
  (act-order included);
- float32 logits equal the reference's to 1e-4 x max(1, |logits|), greedy tokens identical;
- LoRA on top equals PEFT over the same dequantized base; a batch mixing adapter and base requests gives each its
  solo tokens;
- a malformed checkpoint names the linear and the tensor; unsupported variants are refused in one line.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.checkpoints.sources import resolve_model
from loraplex.checkpoints.weights import load_state_dict
from loraplex.config import EngineConfig
from loraplex.engine.loading import build_model, load_model
from loraplex.models.registry import config_from_hf
from loraplex.params import SamplingParams
from loraplex.quantization import QuantizationError, dequantized_weight, is_quantized, weight_bytes
from loraplex.quantization.checkpoint_format import checkpoint_format
from loraplex.quantization.w4a16.mode import W4A16Linear, pack_int4, unpack_int4
from loraplex.quantization.w4a16.formats import detect
from tests.helpers import engine_for, full_logits, tiny_hf_model
from tests.lora.peft_helpers import ALL_PROJECTIONS, peft_model, reference_greedy, reference_logits, save_and_load
from tests.quantization import w4a16_checkpoints as ckpt

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

SHAPE = dict(hidden_size=128, intermediate_size=256)  # input widths 128 and 256: groups of 32, 64 and 128 fit
PROMPT = [1, 17, 203, 45, 9, 88, 130, 7, 251, 64, 3, 99, 180, 42, 5, 77, 211, 8, 150, 33, 120]
NEW = 8
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True)

CASES = {  # id -> (format, group size, symmetric, act-order)
    "gptq-g128-sym": ("gptq", 128, True, False),
    "gptq-g32-act-order": ("gptq", 32, False, True),
    "gptq-per-channel": ("gptq", -1, False, False),
    "awq-g64": ("awq", 64, False, False),
    "awq-g128": ("awq", 128, False, False),
    "ct-g128-sym": ("compressed-tensors", 128, True, False),
    "ct-g32-actorder": ("compressed-tensors", 32, False, True),
    "ct-channel": ("compressed-tensors", -1, False, False),
}


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=3, **SHAPE)


def ours_from_dir(path, dtype=torch.float32):
    """Our model from a quantized checkpoint directory, as load_model builds it."""
    source = resolve_model(path)
    fmt = checkpoint_format(source.hf_config)
    config = config_from_hf(source.hf_config)
    state = load_state_dict(source, dtype=dtype, keep_stored=fmt.keeps_stored_dtype)
    return build_model(config, state, fmt, torch.device("cpu"), dtype), config


@pytest.fixture(scope="module")
def saved(hf, tmp_path_factory):
    """Each case's checkpoint directory and float reference, written once."""
    out = {}
    for case, (fmt, group, symmetric, act_order) in CASES.items():
        path = tmp_path_factory.mktemp(case)
        out[case] = (path, ckpt.write_checkpoint(hf, path, fmt, group, symmetric, act_order))
    return out


@pytest.mark.parametrize("case", CASES)
def test_logits_and_tokens_match_the_dequantized_model(saved, case):
    path, reference = saved[case]
    ours, config = ours_from_dir(path)
    layers = {name: m for name, m in ours.named_modules() if isinstance(m, W4A16Linear)}
    assert len(layers) == 7 * 2 and not is_quantized(ours.lm_head)
    want_weights = dict(reference.named_modules())
    for name, layer in layers.items():
        hf_name = next(n for n in want_weights if n.endswith(name.removeprefix("model.")) and "layers" in n)
        assert torch.equal(dequantized_weight(layer), want_weights[hf_name].weight), name
    assert (layers["model.layers.0.self_attn.q_proj"].perm is not None) == CASES[case][3]
    want = reference_logits(reference, PROMPT)
    got = full_logits(ours, config, PROMPT)
    torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=0)
    engine = engine_for(ours, config, max_batch_total_tokens=1024)
    assert engine.generate([PROMPT], PARAMS)[0].token_ids == reference_greedy(reference, PROMPT, NEW)


def test_lora_on_w4a16_matches_peft_and_batch_equals_solo(saved, tmp_path):
    path, reference = saved["gptq-g32-act-order"]
    ours, config = ours_from_dir(path)
    trained = peft_model(reference, seed=1, r=8, lora_alpha=16, target_modules=list(ALL_PROJECTIONS))
    engine = engine_for(ours, config, max_batch_total_tokens=1024, max_active_adapters=2)
    adapter = save_and_load(trained, tmp_path, "a", engine.lora.base_shapes,
                            base_weight=lambda m: dequantized_weight(ours.get_submodule(m)))
    assert all(isinstance(engine.lora.layers[m].base, W4A16Linear) for m in adapter.modules)
    want = reference_logits(trained, PROMPT)
    got = full_logits(ours, config, PROMPT, adapter=adapter)
    torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=0)
    assert (want - reference_logits(reference, PROMPT)).abs().max() > 1e-2, "the adapter barely matters"
    prompts = [PROMPT, PROMPT[:9], [5, 6, 7, 8, 9, 10, 11], PROMPT[3:]]
    adapters = [adapter, None, adapter, None]
    solo = [engine.generate([p], PARAMS, adapters=[a])[0].token_ids for p, a in zip(prompts, adapters)]
    assert solo[:2] == [reference_greedy(trained, prompts[0], NEW), reference_greedy(reference, prompts[1], NEW)]
    assert [o.token_ids for o in engine.generate(prompts, PARAMS, adapters=adapters)] == solo


def test_load_model_reads_a_gptq_checkpoint(hf, tmp_path):
    from tests.helpers import tiny_seq2seq_tokenizer

    reference = ckpt.write_checkpoint(hf, tmp_path, "gptq", 64, symmetric=False, act_order=True)
    tiny_seq2seq_tokenizer("bart").save_pretrained(tmp_path)  # load_model reads one (any will do here)
    logs: list[str] = []
    loaded = load_model(EngineConfig(model_id=str(tmp_path), device="cpu", dtype="float32"), log=logs.append)
    assert any("read gptq 4-bit, groups of 64, act-order weights" in line for line in logs), logs
    float_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    assert weight_bytes(loaded.model) < 0.6 * float_bytes  # embeddings and head stay float32
    want = reference_logits(reference, PROMPT)
    got = full_logits(loaded.model, loaded.config, PROMPT)
    torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=0)


@pytest.mark.parametrize("fmt, suffix", [("gptq", "scales"), ("awq", "qzeros"), ("compressed-tensors", "weight_packed")])
def test_a_malformed_checkpoint_names_the_tensor(hf, tmp_path, fmt, suffix):
    from safetensors.torch import load_file, save_file

    ckpt.write_checkpoint(hf, tmp_path, fmt, 64)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = f"model.layers.1.mlp.down_proj.{suffix}"
    state[name] = state[name][:-1].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(QuantizationError, match=rf"model\.layers\.1\.mlp\.down_proj: .*{suffix} has shape"):
        ours_from_dir(tmp_path)


@pytest.mark.parametrize("qconfig, says", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}, "gptq_v2"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "marlin"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 256}, "group_size 256"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, "exllama"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, "8-bit"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int"}}}}, "int-quantized"),
])
def test_unsupported_variants_are_refused_in_one_line(qconfig, says):
    with pytest.raises(QuantizationError, match=says) as raised:
        detect(qconfig)
    assert "\n" not in str(raised.value)


def test_float_compressed_tensors_is_left_to_fp8():
    qconfig = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}
    assert detect(qconfig) is None and detect({"quant_method": "fp8"}) is None


def test_packing_matches_compressed_tensors_and_round_trips():
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (256, 40), generator=gen, dtype=torch.uint8)
    for block in (8, 128):
        assert torch.equal(unpack_int4(pack_int4(q, block), block), q)
    # Our sequential packing (blocks of 8) is compressed-tensors' along K, its values shifted by 8.
    ours = pack_int4(q, 8).t().contiguous()  # [N, K/8]
    theirs = unpack_from_int32(ours, 4, torch.Size([40, 256]))
    assert torch.equal(theirs.to(torch.int16) + 8, q.t().to(torch.int16))
    # The tests' GPTQ packer, read element by element from the published layout.
    words = ckpt.pack_nibbles(q, 0)
    assert all(((int(words[i // 8, n]) >> (4 * (i % 8))) & 0xF) == int(q[i, n]) for i, n in [(0, 0), (13, 7), (255, 39)])
    awq = ckpt.pack_nibbles(q, 1, ckpt.AWQ_ORDER)
    assert all(((int(awq[k, c // 8]) >> (4 * ckpt.AWQ_ORDER.index(c % 8))) & 0xF) == int(q[k, c])
               for k, c in [(0, 1), (5, 14), (200, 39)])


def test_from_float_rounds_a_linear_to_4_bits():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 48, bias=True)
    layer = W4A16Linear.from_float(linear, 64)
    steps = (linear.weight - layer.dequantized()).abs() / layer.scales.float().repeat_interleave(64, 0).t()
    assert steps.max() <= 1.0 and steps.mean() < 0.3 and torch.equal(layer.bias, linear.bias)  # edges may clamp
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x), x @ layer.dequantized().t() + linear.bias)


class _Siblings(torch.nn.Module):
    SIBLINGS = (("q", "k", "v"),)

    def __init__(self, bias: bool, act_order_k: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        layers = []
        for n in (128, 64, 64):
            linear = torch.nn.Linear(128, n, bias=bias)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(n, 128, generator=gen) / 12)
            layers.append(W4A16Linear.from_float(linear, 32))
        self.q, self.k, self.v = layers
        if act_order_k:  # a sibling whose inputs are sorted its own way cannot share one product
            q, zeros, scales = self.k.unpacked(), self.k.zeros, self.k.scales
            g_idx = torch.randperm(128, generator=gen) // 32
            self.k = W4A16Linear(q, zeros, scales, 32, g_idx.to(torch.int32), bias, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("bias", [False, True])
def test_w4a16_siblings_fuse_into_one_product_over_views(bias):
    from loraplex.layers.projections import fuse_projections, project
    from loraplex.lora.step.layers import wrap_linears

    owner = _Siblings(bias)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4))
    alone = [getattr(owner, n)(x) for n in "qkv"]
    weights = [getattr(owner, n).dequantized() for n in "qkv"]
    wrap_linears(owner)
    assert fuse_projections(owner) == 1
    fused = owner.fused_projections[("q", "k", "v")]
    assert isinstance(fused.layer, W4A16Linear) and fused.sizes == (128, 64, 64)
    assert owner.v.base.qweight.data_ptr() == fused.layer.qweight[:, 192:].data_ptr()  # views, no second copy
    for got, want in zip(project(owner, x, ("q", "k", "v")), alone):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, weight in zip("qkv", weights):
        assert torch.equal(getattr(owner, name).base.dequantized(), weight)


def test_act_order_siblings_stay_apart():
    from loraplex.layers.projections import fuse_projections

    owner = _Siblings(False, act_order_k=True)
    assert owner.k.perm is not None
    assert fuse_projections(owner) == 0
