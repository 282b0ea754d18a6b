"""LoRA on Mixtral and Qwen2-MoE against PEFT 0.21 on transformers 5.25: adapters on the attention projections, on
every expert's projections and on the router `gate`, in both namings an adapter can carry:

- "stacked": what PEFT 0.21 writes on transformers 5 (whose experts are stacked): `target_parameters` LoRA on
  `experts.gate_up_proj` / `experts.down_proj` (nested `ParamWrapper`s) and on the router's `gate.weight`. For
  Mixtral PEFT converts the transformers 4 names a user writes (`target_modules` w1/w2/w3/gate) into these itself;
  Qwen2-MoE users name the parameters. lora/step/expert_slices.py cuts them into each expert's projections.
- "per_expert": what adapters trained under transformers 4 carry, each expert's linears by name
  (`block_sparse_moe.experts.3.w1` for Mixtral). PEFT 0.21 converts Mixtral's on load (the reference here); it
  cannot load Qwen2-MoE's at all (its router is no longer a linear), so there the reference is the transformers
  model with each delta merged into its weights.

Logits close to the reference, greedy tokens through the engine equal to its `generate`, a batch mixing the base
model and two adapters equal to each alone, in the segment, stacked and per-row LoRA forms; the adapter's expert
weights go through the slots as any adapter's do."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import loraplex.lora.step.plan as lora_plan
from loraplex.lora.adapter import AdapterInvalid, load_adapter_dir
from loraplex.lora.step.kernels import add_lora_rows_reference
from loraplex.lora.step.kernels.tiles import reference_row_slots
from loraplex.lora.merge import merge_adapters
from loraplex.params import SamplingParams
from tests.helpers import engine_for, full_logits, ours_from_hf
from tests.lora.peft_helpers import peft_from_dir, peft_model, reference_greedy, reference_logits
from tests.moe_fixtures import hub_module_name, merged, tiny_moe, write_peft_adapter

NEW = 10
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 1, 64, 128, 11, 12, 13, 14, 200, 201, 202, 9], [3, 1, 4, 1, 5], [77, 30]]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# What a user asks PEFT for on each model (PEFT 0.21 turns Mixtral's expert and router names into target_parameters).
STACKED = {
    "mixtral": dict(r=4, lora_alpha=8, target_modules=[*ATTENTION, "w1", "w2", "w3", "gate"]),
    "qwen2_moe": dict(r=4, lora_alpha=8, target_modules=ATTENTION,
                      target_parameters=["experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight"]),
}
# A second adapter of the stacked form: one stacked parameter (no nesting), another rank and alpha.
DOWN_ONLY = dict(r=8, lora_alpha=4, target_modules=["v_proj"], target_parameters=["experts.down_proj"])
STRENGTH = 1.5  # B drawn so that each delta matters (PEFT's B spans every expert: per expert it is smaller)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Case:
    """One model with its adapters: each (ours, reference model) by name."""

    def __init__(self, kind: str, tmp) -> None:
        self.kind = kind
        self.hf = tiny_moe(kind, seed=2)
        self.ours, self.config = ours_from_hf(self.hf)
        self.targets = engine_for(self.ours, self.config, max_active_adapters=1).adapter_targets()
        self.dirs, self.adapters, self.references = {}, {}, {}
        self._add("stacked", tmp, peft_model(self.hf, seed=1, strength=STRENGTH, **STACKED[kind]))
        self._add("down_only", tmp, peft_model(self.hf, seed=2, strength=STRENGTH, **DOWN_ONLY))
        self._add_per_expert(tmp)

    def load(self, directory, name: str):
        t = self.targets
        return load_adapter_dir(directory, name, t.base_shapes, t.max_rank, t.base_weight, t.checkpoint_name)

    def _add(self, name: str, tmp, model) -> None:
        directory = tmp / f"{self.kind}-{name}"
        model.save_pretrained(str(directory))
        self.dirs[name], self.adapters[name], self.references[name] = directory, self.load(directory, name), model

    def _add_per_expert(self, tmp) -> None:
        """Random per-expert LoRA (every expert's three projections, the router, q and v) as transformers 4 names
        it; the reference is PEFT's reading of it (Mixtral) or the merged weights (Qwen2-MoE)."""
        g = torch.Generator().manual_seed(7)
        shapes, rank, alpha = self.targets.base_shapes, 4, 16
        names = [n for n in shapes if n.endswith(("self_attn.q_proj", "self_attn.v_proj", "mlp.gate"))
                 or ".mlp.experts." in n]
        modules = {}
        for name in names:
            in_features, out_features = shapes[name]
            a = torch.randn(rank, in_features, generator=g) / math.sqrt(in_features)
            modules[name] = (a, torch.randn(out_features, rank, generator=g) * STRENGTH / math.sqrt(rank) / 2)
        leaves = ["q_proj", "v_proj", "gate", *(["w1", "w2", "w3"] if self.kind == "mixtral"
                                               else ["gate_proj", "up_proj", "down_proj"])]
        directory = tmp / f"{self.kind}-per_expert"
        write_peft_adapter(self.kind, directory, modules, dict(r=rank, lora_alpha=alpha, target_modules=leaves))
        reference = (peft_from_dir(self.hf, directory) if self.kind == "mixtral"
                     else merged(self.hf, {n: alpha / rank * b @ a for n, (a, b) in modules.items()}))
        self.dirs["per_expert"], self.references["per_expert"] = directory, reference
        self.adapters["per_expert"] = self.load(directory, "per_expert")
        self.per_expert_modules = modules


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def case(request, tmp_path_factory):
    return Case(request.param, tmp_path_factory.mktemp("moe_lora"))


@pytest.fixture(scope="module")
def greedy(case):
    """Reference greedy tokens per (adapter name or None, prompt index), computed once."""
    cache = {}

    def tokens(name: str | None, i: int) -> list[int]:
        if (name, i) not in cache:
            model = case.hf if name is None else case.references[name]
            cache[name, i] = reference_greedy(model, PROMPTS[i], NEW)
        return cache[name, i]

    return tokens


def _engine(case, **kw):
    return engine_for(case.ours, case.config, max_batch_total_tokens=4096, **kw)


def _experts(config) -> list[int]:
    return [i for i, sparse in enumerate(config.moe.sparse_layers) if sparse]


def test_peft_writes_expert_lora_on_the_stacked_parameters(case):
    """The form PEFT 0.21 saves on transformers 5.25, and what our loader makes of it: every expert's projections
    and the router, in each sparse layer."""
    config = json.loads((case.dirs["stacked"] / "adapter_config.json").read_text())
    assert {"gate_up_proj", "down_proj"} <= {p.rsplit(".", 1)[-1] for p in config["target_parameters"]}
    tensors = load_file(case.dirs["stacked"] / "adapter_model.safetensors")
    layer = _experts(case.config)[0]
    prefix = f"base_model.model.model.layers.{layer}.mlp"
    moe, hidden = case.config.moe, case.config.hidden_size
    rank = 8 if case.kind == "mixtral" else 4  # PEFT doubles Mixtral's r (and alpha) for the fused w1 + w3
    assert tensors[f"{prefix}.experts.base_layer.lora_A.weight"].shape == (moe.num_experts * rank, hidden)  # gate_up
    assert tensors[f"{prefix}.experts.base_layer.lora_B.weight"].shape == (2 * moe.intermediate_size, moe.num_experts * rank)
    assert tensors[f"{prefix}.experts.lora_A.weight"].shape == (moe.num_experts * 4, moe.intermediate_size)  # down
    assert f"{prefix}.gate.lora_A.weight" in tensors
    assert not any(".experts.0." in key for key in tensors)

    modules = case.adapters["stacked"].modules
    for layer in _experts(case.config):
        mlp = f"model.layers.{layer}.mlp"
        assert {f"{mlp}.gate", *(f"{mlp}.experts.{e}.{p}" for e in range(moe.num_experts)
                                 for p in ("gate_proj", "up_proj", "down_proj"))} <= set(modules)
    # Each expert's projection holds its part of PEFT's delta for the stacked parameter, exactly.
    wrapper = dict(case.references["stacked"].named_modules())[f"base_model.model.model.layers.{layer}.mlp.experts"]
    delta = wrapper.base_layer.get_delta_weight("default")  # gate_up_proj [E, 2I, H]
    expert = modules[f"model.layers.{layer}.mlp.experts.2.up_proj"]
    torch.testing.assert_close(expert.scale * expert.b @ expert.a, delta[2, moe.intermediate_size:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["stacked", "down_only", "per_expert"])
def test_logits_match_the_reference(case, name):
    reference, adapter = case.references[name], case.adapters[name]
    for prompt in PROMPTS[:2]:
        expected = reference_logits(reference, prompt)
        torch.testing.assert_close(full_logits(case.ours, case.config, prompt, adapter=adapter), expected,
                                   atol=2e-4, rtol=1e-4)
        base = reference_logits(case.hf, prompt)
        assert (expected - base).abs().max() > 0.1 * base.abs().max(), f"{name} changes little: the test proves little"


def test_the_router_lora_changes_the_routing(case):
    """The router's LoRA alone moves tokens to other experts (and so the reference's agreement above covers it)."""
    adapter = case.adapters["stacked"]
    layer = _experts(case.config)[0]
    gate = adapter.modules[f"model.layers.{layer}.mlp.gate"]
    x = torch.randn(64, case.config.hidden_size, generator=torch.Generator().manual_seed(0))
    router = case.ours.model.layers[layer].mlp.gate
    weight = router.weight if hasattr(router, "weight") else router.base.weight
    before = (x @ weight.t()).topk(case.config.moe.top_k).indices.sort().values
    after = (x @ (weight + gate.scale * gate.b @ gate.a).t()).topk(case.config.moe.top_k).indices.sort().values
    assert (before != after).any(dim=-1).float().mean() > 0.2


@pytest.mark.parametrize("name", ["stacked", "per_expert"])
def test_greedy_tokens_match_the_reference(case, greedy, name):
    engine = _engine(case, max_active_adapters=2)
    got = [o.token_ids for o in engine.generate(PROMPTS, PARAMS, adapters=[case.adapters[name]] * len(PROMPTS))]
    assert got == [greedy(name, i) for i in range(len(PROMPTS))]
    assert got != [greedy(None, i) for i in range(len(PROMPTS))], f"{name} changes no token: the test proves nothing"


def _per_row_on_the_cpu(table):
    """The per-row form's kernels (Triton, CUDA only) as their torch reference: each row its own slot's delta."""

    def add(outs, x, per_row, names):
        slots = reference_row_slots(per_row.tiles, x.shape[0]) if per_row.tiles is not None else per_row.slots.tolist()
        for out, name in zip(outs, names):
            add_lora_rows_reference(out, x, slots, [table.columns[name][s] for s in range(table.num_slots)])

    return add


@pytest.mark.parametrize("form", ["segments", "stacked", "per_row"])
def test_a_mixed_batch_equals_each_alone(case, greedy, form, monkeypatch):
    """Every prompt under the base model and under two adapters of the stacked form (one nesting both stacked
    parameters and the router, one on down_proj alone) in one batch: the rows of several adapters share experts."""
    variants = [None, "stacked", "down_only"]
    jobs = [(i, v) for i in range(len(PROMPTS)) for v in variants]
    engine = _engine(case, max_active_adapters=len(variants))
    engine.runner.lora_planner.stacked_rows_per_segment = 10**6 if form == "stacked" else 0
    if form == "per_row":
        monkeypatch.setattr(lora_plan, "_add_per_row", _per_row_on_the_cpu(engine.lora))
        engine.runner.lora_planner.per_row = True
    used = []
    real = lora_plan.LoraPlanner.plan
    monkeypatch.setattr(lora_plan.LoraPlanner, "plan", lambda self, *a, **k: used.append(real(self, *a, **k)) or used[-1])
    outs = engine.generate([PROMPTS[i] for i, _ in jobs], PARAMS,
                           adapters=[None if v is None else case.adapters[v] for _, v in jobs])
    assert [o.token_ids for o in outs] == [greedy(v, i) for i, v in jobs]
    plans = [p for p in used if p is not None]
    took = {"segments": lambda p: p.stack is None and not p.per_row and len(p.tokens) > 1,
            "stacked": lambda p: p.stack is not None, "per_row": lambda p: "tokens" in p.per_row}[form]
    assert any(took(p) for p in plans), f"no step took the {form} form"


def test_expert_weights_are_uploaded_and_evicted_with_their_slot(case, greedy):
    """One slot, three adapters in turn: each install replaces the slot's expert weights (they are the table's, as
    any linear's), and an adapter evicted and installed again computes as before."""
    engine = _engine(case, max_active_adapters=1)
    layer = _experts(case.config)[0]
    name = f"model.layers.{layer}.mlp.experts.1.gate_proj"
    for adapter_name in ["stacked", "per_expert", "down_only", "stacked"]:
        adapter = case.adapters[adapter_name]
        got = engine.generate(PROMPTS[1:2], PARAMS, adapters=[adapter])[0].token_ids
        assert got == greedy(adapter_name, 1), adapter_name
        assert engine.lora.occupant == [adapter.key]
        held = engine.lora.module_weights(0, name)
        if adapter_name == "down_only":  # targets no expert's gate_proj: the slot holds none for it
            assert held is None
        else:
            want = adapter.modules[name]
            assert torch.equal(held.a, want.a) and torch.equal(held.b, want.b) and held.scale == want.scale


# ---- refusals ----------------------------------------------------------------------------------------------------


def _rewritten(case, tmp_path, name: str, tensors=None, config=None):
    """A copy of adapter `name` with some tensors and config fields replaced."""
    source = case.dirs[name]
    saved = load_file(source / "adapter_model.safetensors")
    raw = json.loads((source / "adapter_config.json").read_text())
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors(saved) if tensors else saved, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(config(raw) if config else raw))
    return tmp_path


def test_a_stacked_lora_that_does_not_fit_is_refused(case, tmp_path):
    key = f"base_model.model.model.layers.{_experts(case.config)[0]}.mlp.experts.lora_A.weight"

    def fewer_experts(t):
        return {**t, key: t[key][:-1].clone()}

    with pytest.raises(AdapterInvalid, match=r"experts\.lora_A\.weight has shape .*\(a LoRA on the stacked down_proj of"):
        case.load(_rewritten(case, tmp_path / "rows", "stacked", tensors=fewer_experts), "bad")

    def untargeted(raw):  # the config no longer targets down_proj, its tensors are still there
        return {**raw, "target_parameters": [p for p in raw["target_parameters"] if not p.endswith("down_proj")]}

    with pytest.raises(AdapterInvalid, match=r"2 nested LoRA\(s\) on its stacked parameters, .* target 1 of them"):
        case.load(_rewritten(case, tmp_path / "config", "stacked", config=untargeted), "bad")


def test_target_parameters_must_be_a_list_of_names(case, tmp_path):
    def as_string(raw):  # PEFT takes no regex here
        return {**raw, "target_parameters": "experts.down_proj"}

    with pytest.raises(AdapterInvalid, match="target_parameters must be a list of parameter names"):
        case.load(_rewritten(case, tmp_path, "down_only", config=as_string), "bad")


def test_a_parameter_lora_beyond_linears_and_experts_is_refused(case, tmp_path):
    """target_parameters on a parameter that is no linear's weight nor stacked experts (a norm's) is refused."""
    norm = "base_model.model.model.layers.0.input_layernorm"
    hidden = case.config.hidden_size

    def with_norm(t):
        return {**t, f"{norm}.lora_A.weight": torch.zeros(4, hidden), f"{norm}.lora_B.weight": torch.zeros(1, 4)}

    def targets_norm(raw):
        return {**raw, "target_parameters": [*raw["target_parameters"], "input_layernorm.weight"]}

    directory = _rewritten(case, tmp_path, "stacked", tensors=with_norm, config=targets_norm)
    with pytest.raises(AdapterInvalid, match=r"no LoRA-capable linear 'model\.layers\.0\.input_layernorm'"):
        case.load(directory, "bad")


def test_merging_a_stacked_adapter_is_refused(case):
    with pytest.raises(AdapterInvalid, match="uses target_parameters: merging such adapters is not served"):
        merge_adapters("merged", [case.adapters["stacked"], case.adapters["per_expert"]], [0.5, 0.5])


def test_per_expert_names_are_transformers_4s(case):
    """The per-expert adapter carries the names transformers 4 gave each expert's linears (so it tests them)."""
    keys = load_file(case.dirs["per_expert"] / "adapter_model.safetensors")
    expected = {"mixtral": "model.layers.0.block_sparse_moe.experts.3.w2",
                "qwen2_moe": "model.layers.0.mlp.experts.3.down_proj"}[case.kind]
    assert hub_module_name(case.kind, "model.layers.0.mlp.experts.3.down_proj") == expected
    assert f"base_model.model.{expected}.lora_A.weight" in keys
