"""FP8 models on the CPU (the emulated product) against transformers on the same checkpoint:

- compressed-tensors `float-quantized` checkpoints written by compressed-tensors itself (its FP8_DYNAMIC preset:
  per-channel weights, per-token activations; FP8: per-tensor weights, static input scales), loaded with
  `load_model`; transformers reads the same directory (decompressing the weights: dequantize=True) and, with each
  quantized linear's input rounded to e4m3 as the scheme says (`with_fp8_inputs`), is the reference: logits to
  1e-4 x max(1, |logits|), greedy tokens equal. Without that rounding transformers' logits differ by ~3% (what the
  comparison would miss);
- `quant_method: fp8` with blocks (transformers' FineGrainedFP8 layout, our own writer, 32 x 32 blocks so that a
  tiny model has several), exact against transformers' dequantized model (it keeps activations in float, as our
  block layer does); its older per-tensor form with static input scales;
- `--quantize fp8` through load_model and the engine against the float model with the same e4m3 weights and inputs;
- LoRA on top equals PEFT on the same reference, whose LoRA reads the unquantized input; a batch mixing adapter and
  base requests gives each its solo tokens.
"""

from __future__ import annotations

import copy
import json
import pathlib
import shutil

import pytest
import torch
from torch import nn

from loraplex.checkpoints.sources import resolve_model
from loraplex.config import EngineConfig
from loraplex.engine.loading import load_model
from loraplex.quantization import is_quantized, weight_bytes
from loraplex.quantization.fp8.layers import Fp8BlockLinear, Fp8Linear
from loraplex.quantization.fp8.numerics import FP8, FP8_MAX
from tests.helpers import engine_for, full_logits, tiny_hf_model
from tests.lora.peft_helpers import ALL_PROJECTIONS, peft_model, reference_greedy, reference_logits, save_and_load
from tests.quantization.test_bnb_cpu import PARAMS, PROMPT, atol, prompts

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

NEW = PARAMS.max_new_tokens
STATIC_INPUT_SCALE = 0.02  # the FP8 preset's input scale, as calibration would set it: saturates past 8.96


# ---- writing the checkpoints -------------------------------------------------------------------------------


def with_tokenizer(path: pathlib.Path) -> pathlib.Path:
    """load_model reads a tokenizer: the embedded model's (the tiny models' ids are all inside its vocabulary)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model(None).path / name, path / name)
    return path


def write_compressed_tensors(hf, path: pathlib.Path, preset: str) -> pathlib.Path:
    """`hf` (float32) quantized by compressed-tensors with `preset` (FP8_DYNAMIC, FP8) and saved as llm-compressor
    saves it: scales set as its min-max observers would (absmax / 448), then ModelCompressor compresses and writes
    the config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme

    model = copy.deepcopy(hf)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                w = module.weight.abs()
                amax = w.amax() if module.weight_scale.numel() == 1 else w.amax(dim=1)
                module.weight_scale.copy_((amax / FP8_MAX).reshape(module.weight_scale.shape))
            if hasattr(module, "input_scale"):
                module.input_scale.fill_(STATIC_INPUT_SCALE)
    compressor = ModelCompressor.from_pretrained_model(model, "float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    return with_tokenizer(path)


def write_fp8(hf, path: pathlib.Path, quantization_config: dict, block: tuple[int, int] | None,
              scale_name: str = "weight_scale_inv", input_scale: tuple[str, float] | None = None) -> pathlib.Path:
    """`hf` with each linear but the head e4m3, as `quant_method: fp8` checkpoints store it: one float32 scale per
    block (transformers' FineGrainedFP8: `weight_scale_inv`, what the block's e4m3 values are multiplied by) or
    per tensor (`block` None), and a static input scale (name, value) when given."""
    from safetensors.torch import load_file, save_file

    hf.save_pretrained(path)
    state = load_file(path / "model.safetensors")
    for name, module in hf.named_modules():
        if type(module) is not nn.Linear or name == "lm_head":
            continue
        w = module.weight.detach().float()
        tile = block or tuple(w.shape)
        rows, cols = -(-w.shape[0] // tile[0]), -(-w.shape[1] // tile[1])
        padded = torch.zeros(rows * tile[0], cols * tile[1])
        padded[: w.shape[0], : w.shape[1]] = w
        blocks = padded.view(rows, tile[0], cols, tile[1])
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)
        q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view_as(padded)
        state[f"{name}.weight"] = q[: w.shape[0], : w.shape[1]].contiguous()
        state[f"{name}.{scale_name}"] = scale if block else scale.reshape(())
        if input_scale is not None:
            state[f"{name}.{input_scale[0]}"] = torch.tensor(input_scale[1])
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return with_tokenizer(path)


# ---- the references ----------------------------------------------------------------------------------------


def with_fp8_inputs(model, static_scales: dict[str, float] | None = None):
    """`model` with each linear but the head reading its input rounded to e4m3 (per-token absmax / 448 scales, or
    the module's static scale), in place: the reference numerics of an FP8 linear. PEFT's LoRA layers, put on
    after, read the unrounded input (their base layer carries the hook)."""
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or name.endswith("lm_head"):
            continue
        static = None if static_scales is None else static_scales[name]

        def rounded(_, args, static=static):
            x = args[0].float()
            scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX if static is None else torch.tensor(static)
            return ((x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).to(args[0].dtype),

        module.register_forward_pre_hook(rounded)
    return model


def transformers_dequantized(path: pathlib.Path, config) -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, device_map="cpu", dtype=torch.float32, attn_implementation="eager"
    ).eval()


def ours(path: pathlib.Path, **engine_config):
    logs: list[str] = []
    loaded = load_model(EngineConfig(model_id=str(path), device="cpu", **engine_config), log=logs.append)
    return loaded, logs


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", seed=0)


def check_against(loaded, reference, unrounded=None):
    want = reference_logits(reference, PROMPT)
    got = full_logits(loaded.model, loaded.config, PROMPT)
    torch.testing.assert_close(got, want, atol=atol(want), rtol=0)
    if unrounded is not None:  # the rounding of the inputs matters: the comparison bites
        assert (reference_logits(unrounded, PROMPT) - got).abs().max() > 10 * atol(want)
    engine = engine_for(loaded.model, loaded.config, max_batch_total_tokens=1024)
    ps = prompts(3)
    assert [o.token_ids for o in engine.generate(ps, PARAMS)] == [reference_greedy(reference, p, NEW) for p in ps]


# ---- the checkpoints ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8"])
def test_compressed_tensors_checkpoint_matches_transformers(hf, tmp_path, preset):
    path = write_compressed_tensors(hf, tmp_path, preset)
    loaded, logs = ours(path)
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Fp8Linear) and q_proj.weight.dtype == FP8 and not is_quantized(loaded.model.lm_head)
    assert (q_proj.input_scale is None) == (preset == "FP8_DYNAMIC")
    assert any("compressed-tensors FP8 per " + ("channel" if preset == "FP8_DYNAMIC" else "tensor") in l for l in logs)

    unrounded = transformers_dequantized(path, transformers.CompressedTensorsConfig(run_compressed=False))
    assert unrounded.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # decompressed
    torch.testing.assert_close(q_proj.dequantized(), unrounded.model.layers[0].self_attn.q_proj.weight, rtol=0, atol=0)
    static = None if preset == "FP8_DYNAMIC" else {n: STATIC_INPUT_SCALE for n, _ in unrounded.named_modules()}
    check_against(loaded, with_fp8_inputs(copy.deepcopy(unrounded), static), unrounded)


def test_fp8_block_checkpoint_is_exact_against_transformers_dequantized(hf, tmp_path):
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
              "modules_to_not_convert": ["lm_head"]}
    path = write_fp8(hf, tmp_path, config, (32, 32))
    loaded, logs = ours(path)
    layer = loaded.model.model.layers[1].mlp.down_proj
    assert isinstance(layer, Fp8BlockLinear) and layer.weight_scale_inv.shape == (2, 4)
    assert any("fp8 blocks of 32x32" in line for line in logs)
    reference = transformers_dequantized(path, transformers.FineGrainedFP8Config(dequantize=True))
    torch.testing.assert_close(layer.dequantized(), reference.model.layers[1].mlp.down_proj.weight.float(),
                               rtol=0, atol=0)
    check_against(loaded, reference, hf)


def test_fp8_per_tensor_static_checkpoint(hf, tmp_path):
    """The older `quant_method: fp8` form (AutoFP8's, as vLLM reads it): per-tensor `weight_scale` and a static
    `input_scale`, no `weight_block_size`. transformers does not read it: the reference is the float model with
    its dequantized weights and inputs rounded with the static scale."""
    path = write_fp8(hf, tmp_path, {"quant_method": "fp8", "activation_scheme": "static"}, None, "weight_scale",
                     ("input_scale", STATIC_INPUT_SCALE))
    loaded, logs = ours(path)
    assert any("fp8 per-tensor, static activations" in line for line in logs)
    reference = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in loaded.model.named_modules():
            if isinstance(module, Fp8Linear):
                assert module.input_scale == STATIC_INPUT_SCALE and module.weight_scale.unique().numel() == 1
                reference.get_submodule(name).weight.copy_(module.dequantized())
    check_against(loaded, with_fp8_inputs(reference, {n: STATIC_INPUT_SCALE for n, _ in hf.named_modules()}), hf)


def test_a_checkpoints_kv_cache_scales_go_into_an_fp8_cache(hf, tmp_path, caplog):
    """Calibrated KV-cache scales (compressed-tensors' `self_attn.k_scale` / `v_scale`; AutoFP8's one `kv_scale`)
    are the FP8 cache's scales; with the model's-dtype cache they are said unused, and the model still loads."""
    from safetensors.torch import load_file, save_file

    from loraplex.engine.engine import Engine

    path = write_fp8(hf, tmp_path, {"quant_method": "fp8", "activation_scheme": "dynamic"}, None, "weight_scale")
    state = load_file(path / "model.safetensors")
    state["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    state["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    state["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    fp8_cache = Engine.from_config(EngineConfig(model_id=str(path), device="cpu", kv_cache_dtype="fp8",
                                                max_batch_total_tokens=256), log=lambda _: None)
    scales = [fp8_cache.runner.kv_caches[i].scales for i in (0, 1)]
    assert torch.equal(scales[0][0], torch.full_like(scales[0][0], 0.5))
    assert torch.equal(scales[0][1], torch.full_like(scales[0][1], 0.25))
    assert torch.equal(scales[1], torch.full_like(scales[1], 2.0))
    with caplog.at_level("WARNING"):
        plain = Engine.from_config(EngineConfig(model_id=str(path), device="cpu", max_batch_total_tokens=256),
                                   log=lambda _: None)
    assert plain.runner.kv_caches[0].__class__.__name__ != "LayerKVCache" or plain.runner.kv_caches[0].scales is None
    assert any("apply with --kv-cache-dtype fp8 only" in r.message for r in caplog.records)
    del state["model.layers.0.self_attn.v_scale"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layer 0 has a KV-cache scale for keys or values only"):
        load_model(EngineConfig(model_id=str(path), device="cpu"), log=lambda _: None)


# ---- --quantize fp8 and LoRA on top ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized(hf, tmp_path_factory):
    """(our --quantize fp8 model, the float model with its e4m3 weights and inputs rounded)."""
    path = with_tokenizer(tmp_path_factory.mktemp("float"))
    hf.save_pretrained(path)
    loaded, logs = ours(path, quantize="fp8")
    assert any(line.startswith("quantized 14 linears (fp8)") for line in logs), logs
    reference = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in loaded.model.named_modules():
            if isinstance(module, Fp8Linear):
                reference.get_submodule(name).weight.copy_(module.dequantized())
    return loaded, with_fp8_inputs(reference)


def test_quantize_fp8_matches_the_rounded_float_model(hf, quantized):
    loaded, reference = quantized
    linears = [m for m in loaded.model.modules() if isinstance(m, Fp8Linear)]
    assert len(linears) == 14 and all(m.weight.dtype == FP8 for m in linears)
    assert weight_bytes(loaded.model) < weight_bytes(hf)
    check_against(loaded, reference, hf)


def test_lora_on_fp8_matches_peft(quantized, tmp_path, monkeypatch):
    from loraplex.engine.worker import runner as runner_module

    loaded, reference = quantized
    model, config = copy.deepcopy(loaded.model), loaded.config  # fused below: the module's model stays unfused
    trained = peft_model(reference, seed=3, r=8, lora_alpha=16, target_modules=list(ALL_PROJECTIONS))
    engine = engine_for(model, config, max_batch_total_tokens=1024, max_active_adapters=2)
    adapter = save_and_load(trained, tmp_path, "a", engine.lora.base_shapes,
                            base_weight=lambda m: model.get_submodule(m).weight)
    assert all(isinstance(engine.lora.layers[m].base, Fp8Linear) for m in adapter.modules)

    want = reference_logits(trained, PROMPT)
    got = full_logits(model, config, PROMPT, adapter=adapter)
    torch.testing.assert_close(got, want, atol=atol(want), rtol=0)
    assert (want - reference_logits(reference, PROMPT)).abs().max() > 100 * atol(want), "the adapter barely matters"

    ps = prompts(4)
    adapters = [adapter, None, adapter, None]
    solo = [engine.generate([p], PARAMS, adapters=[a])[0].token_ids for p, a in zip(ps, adapters)]
    assert solo[:2] == [reference_greedy(trained, ps[0], NEW), reference_greedy(reference, ps[1], NEW)]
    assert [o.token_ids for o in engine.generate(ps, PARAMS, adapters=adapters)] == solo

    # q/k/v and gate/up in one FP8 product each (as the runner fuses them on CUDA), the adapter on each sibling.
    monkeypatch.setattr(runner_module, "fused_projections_wanted", lambda device: True)
    fused = engine_for(model, config, max_batch_total_tokens=1024, max_active_adapters=2)
    assert isinstance(model.model.layers[0].mlp.fused_projections[("gate_proj", "up_proj")].layer, Fp8Linear)
    assert [o.token_ids for o in fused.generate(ps, PARAMS, adapters=adapters)] == solo
