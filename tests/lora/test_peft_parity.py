"""LoRA serving against PEFT on the same adapter: logits close, greedy tokens identical.

Adapters are made by PEFT (random A and B, large enough that every adapter visibly changes the
output), saved with `save_pretrained` and read back by our loader, as the server reads them. Each
configuration option that decides which modules get a delta, and with what rank and scale, has a case
on a tiny random Llama; the embedded SmolLM2 gets a few combined cases. PEFT always works on a deep
copy of the transformers model: the session-shared `embedded_hf` is never modified.
"""

from __future__ import annotations

import asyncio
import pathlib
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.lora.adapter import AdapterInvalid, load_adapter_dir
from loraplex.lora.sources.store import AdapterStore, MergeSpec
from loraplex.params import SamplingParams
from tests.helpers import engine_for, full_logits, ours_from_hf, tiny_hf_model
from tests.lora.peft_helpers import (
    ALL_PROJECTIONS,
    add_random_adapter,
    lora_layers,
    peft_from_dir,
    peft_model,
    reference_greedy,
    reference_logits,
    reference_step_logits,
    save_and_load,
)

# PEFT's notes on saving the output head's weights, weight tying, and pattern keys matching nothing.
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:peft"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:peft"),
]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """These models and batches are small: a second intra-op thread gains little, and on a shared CPU its
    spin-waits cost several times the work (measured: ~20 s vs ~2 min for this file under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


ALL = list(ALL_PROJECTIONS)
HEAD_COPY = "base_model.model.lm_head.base_layer.weight"

# Tiny model: 21 prompt tokens cross a 16-token KV block; 9 + 12 tokens cross one while decoding.
LOGITS_PROMPT = [1, 17, 203, 45, 9, 88, 130, 7, 251, 64, 3, 99, 180, 42, 5, 77, 211, 8, 150, 33, 120]
GREEDY_PROMPT = [1, 5, 9, 33, 2, 7, 100, 4, 61]
NEW_TOKENS = 12

TINY_CASES = {
    "r4": dict(r=4, lora_alpha=8, target_modules=ALL),
    "r8_attention": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "r16": dict(r=16, lora_alpha=16, target_modules=ALL),
    "r64": dict(r=64, lora_alpha=32, target_modules=ALL),
    "rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=ALL),
    "rank_pattern": dict(
        r=8, lora_alpha=16, target_modules=ALL, rank_pattern={"q_proj": 4, r"layers\.1\.mlp\.down_proj": 32},
    ),
    "alpha_pattern": dict(
        r=8, lora_alpha=16, target_modules=ALL, alpha_pattern={"v_proj": 64, "model.layers.0.mlp.up_proj": 2},
    ),
    "rslora_rank_and_alpha_patterns": dict(
        r=8, lora_alpha=16, use_rslora=True, target_modules=ALL,
        rank_pattern={"o_proj": 16, "gate_proj": 4}, alpha_pattern={"o_proj": 4, "k_proj": 32},
    ),
    # PEFT's matching: the first key (in the saved file's order: sorted) that matches the name's end after
    # a dot wins; keys are regexes. "proj" matches nothing ("q_proj" has no dot before "proj"),
    # "mlp.up_proj" takes up_proj before "up_proj" does, and k_proj gets "k_proj"'s alpha from the file
    # although the model that saved it used the regex's (a PEFT save/reload quirk; the file is what we serve).
    "pattern_matching_rules": dict(
        r=8, lora_alpha=16, target_modules=ALL,
        rank_pattern={"proj": 4, "mlp.up_proj": 16, "up_proj": 2, r"layers\.[12]\.self_attn\.o_proj": 32},
        alpha_pattern={"_proj": 1, r"self_attn\.(k|v)_proj": 64, "k_proj": 2},
    ),
    "layers_to_transform": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[0, 2],
    ),
    "layers_to_transform_with_layers_pattern": dict(
        r=8, lora_alpha=16, target_modules=ALL, layers_to_transform=[1], layers_pattern="layers",
    ),
    "layers_to_transform_int_with_pattern_list": dict(
        r=8, lora_alpha=16, target_modules=["o_proj", "up_proj"], layers_to_transform=2, layers_pattern=["layers"],
    ),
    "target_q_v_only": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "target_regex": dict(
        r=8, lora_alpha=16, target_modules=r".*\.layers\.[02]\.(self_attn\.(q|o)_proj|mlp\.gate_proj)",
    ),
    "exclude_modules": dict(
        r=8, lora_alpha=16, target_modules=ALL, exclude_modules=["k_proj", "model.layers.2.mlp.up_proj"],
    ),
    "lm_head_and_all_projections": dict(r=8, lora_alpha=16, target_modules=[*ALL, "lm_head"]),
    "lm_head_only": dict(r=4, lora_alpha=4, target_modules=["lm_head"]),
}


@dataclass
class Tiny:
    hf: object
    ours: object
    config: object
    engine: object
    base_logits: torch.Tensor  # transformers, without adapter
    base_tokens: list[int]

    def base_weight(self, module: str) -> torch.Tensor:
        return self.ours.get_submodule(module).weight


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    hf = tiny_hf_model("llama", seed=0, num_hidden_layers=3)
    ours, config = ours_from_hf(hf)
    engine = engine_for(ours, config, max_active_adapters=4)
    return Tiny(
        hf, ours, config, engine, reference_logits(hf, LOGITS_PROMPT), reference_greedy(hf, GREEDY_PROMPT, NEW_TOKENS)
    )


def _atol(expected: torch.Tensor) -> float:
    """float32: 1e-4, scaled to the logits' magnitude."""
    return 1e-4 * max(1.0, expected.abs().max().item())


def _run(engine, requests) -> tuple[list[tuple[list[int], list[float]]], int]:
    """Queue every (prompt, new tokens, adapter) at once and step to the end: per request its greedy tokens
    and their reported logprobs, and how many requests produced a token in the first step."""
    ids = [
        engine.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), adapter=adapter).request_id
        for prompt, n, adapter in requests
    ]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list[float]] = {i: [] for i in ids}
    first_step = None
    while engine.has_unfinished:
        outs = engine.step()
        first_step = len(outs) if first_step is None else first_step
        for out in outs:
            tokens[out.request_id].append(out.token.id)
            logprobs[out.request_id].append(out.token.logprob)
    return [(tokens[i], logprobs[i]) for i in ids], first_step


def _assert_logprobs_match(model, prompt: list[int], tokens: list[int], logprobs: list[float]) -> None:
    """Our reported logprob of each generated token (from the engine's prefill / decode logits rows)
    equals the reference's log_softmax of its logits at that position."""
    logits = reference_step_logits(model, prompt, tokens)
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=2 * _atol(logits), rtol=0)


def _assert_config_read_as_peft(adapter, model, base_shapes, name: str = "default") -> None:
    """Our reading of adapter_config.json puts a delta exactly where PEFT does, with PEFT's rank and scale."""
    layers = lora_layers(model, name)
    assert set(adapter.modules) == set(layers)
    wrongly = [m for m in base_shapes if adapter.config.targets(m) != (m in layers)]
    assert not wrongly, f"targets() disagrees with PEFT on {wrongly}"
    for module, layer in layers.items():
        weights = adapter.modules[module]
        assert weights.rank == layer.r[name], module
        assert weights.scale == pytest.approx(layer.scaling[name], rel=1e-12), module


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_tiny_llama_matches_peft(tiny: Tiny, tmp_path: pathlib.Path, case: str) -> None:
    trained = peft_model(tiny.hf, seed=list(TINY_CASES).index(case) + 1, **TINY_CASES[case])
    shapes = tiny.engine.lora.base_shapes
    adapter = save_and_load(trained, tmp_path, f"tiny-{case}", shapes, base_weight=tiny.base_weight)
    model = peft_from_dir(tiny.hf, tmp_path)  # PEFT reading the very files we read
    _assert_config_read_as_peft(adapter, model, shapes)
    if "lm_head" in adapter.modules:  # PEFT saved the head's base weights too, and we accepted the copy
        assert HEAD_COPY in load_file(tmp_path / "adapter_model.safetensors")

    expected = reference_logits(model, LOGITS_PROMPT)
    got = full_logits(tiny.ours, tiny.config, LOGITS_PROMPT, adapter=adapter)
    atol = _atol(expected)
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    assert (expected - tiny.base_logits).abs().max() > 100 * atol, "the adapter barely changes the logits"

    expected_tokens = reference_greedy(model, GREEDY_PROMPT, NEW_TOKENS)
    ((tokens, logprobs),), _ = _run(tiny.engine, [(GREEDY_PROMPT, NEW_TOKENS, adapter)])
    assert tokens == expected_tokens
    assert expected_tokens != tiny.base_tokens, "the adapter does not change the greedy tokens"
    _assert_logprobs_match(model, GREEDY_PROMPT, tokens, logprobs)


def test_tiny_mixed_batch_gives_each_request_its_solo_tokens(tiny: Tiny, tmp_path: pathlib.Path) -> None:
    specs = {
        "r4": TINY_CASES["r4"],
        "r64-rslora": dict(r=64, lora_alpha=16, use_rslora=True, target_modules=ALL),
        "qv-head": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "lm_head"]),
        "regex": TINY_CASES["target_regex"],
    }
    models, adapters = {}, {}
    for seed, (name, spec) in enumerate(specs.items(), start=100):
        adapters[name] = save_and_load(
            peft_model(tiny.hf, seed=seed, **spec), tmp_path / name, f"mixed-{name}", tiny.engine.lora.base_shapes,
            base_weight=tiny.base_weight,
        )
        models[name] = peft_from_dir(tiny.hf, tmp_path / name)
    prompts = [GREEDY_PROMPT, LOGITS_PROMPT, [1, 200, 3], LOGITS_PROMPT[:15]]
    # (prompt, adapter or None, new tokens): adapters interleaved with the base and each other, different
    # lengths, so that segments change as requests finish.
    plan = [
        (0, "r4", 12), (1, None, 9), (2, "r64-rslora", 12), (0, "qv-head", 7), (1, "r4", 10),
        (3, None, 12), (1, "regex", 8), (0, "r64-rslora", 11), (3, "qv-head", 12), (2, "r4", 6),
    ]
    engine = engine_for(tiny.ours, tiny.config, max_active_adapters=4)
    solo = []
    for p, name, n in plan:
        ((tokens, _),), _ = _run(engine, [(prompts[p], n, adapters.get(name))])
        assert tokens == reference_greedy(models[name] if name else tiny.hf, prompts[p], n), (p, name)
        solo.append(tokens)
    assert len({tuple(tokens[:6]) for tokens in solo}) >= 8, "requests should not all produce the same tokens"

    mixed, first_step = _run(engine, [(prompts[p], n, adapters.get(name)) for p, name, n in plan])
    assert first_step == len(plan), "all requests should be prefilled together, in the first step"
    assert [tokens for tokens, _ in mixed] == solo
    for (p, name, _), (tokens, logprobs) in zip(plan, mixed):
        _assert_logprobs_match(models[name] if name else tiny.hf, prompts[p], tokens, logprobs)


@pytest.mark.parametrize("strategy, density", [("linear", 1.0), ("cat", 1.0), ("ties", 0.6), ("magnitude_prune", 0.5)])
def test_merged_request_gives_peft_merged_adapters_tokens(tiny: Tiny, tmp_path: pathlib.Path, strategy, density) -> None:
    """A request for a merge (LoRAX's merged_adapters, through the store) answers as PEFT's add_weighted_adapter.

    The first adapter uses rsLoRA: PEFT >= 0.22 gives the merge a scale of 1, where it used to scale the
    merged delta by sqrt(r) a second time."""
    model = peft_model(tiny.hf, seed=31, r=8, lora_alpha=8, use_rslora=True, target_modules=ALL)
    add_random_adapter(model, "plain", seed=32, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])
    model.save_pretrained(str(tmp_path / "rs"), selected_adapters=["default"])
    model.save_pretrained(str(tmp_path), selected_adapters=["plain"])  # PEFT writes a named adapter to tmp_path/plain
    weights = (0.7, -0.9)
    model.base_model.add_weighted_adapter(
        ["default", "plain"], list(weights), "merged", combination_type=strategy, density=density
    )
    model.set_adapter("merged")
    expected = reference_greedy(model.eval(), GREEDY_PROMPT, NEW_TOKENS)

    store = AdapterStore(tiny.engine.lora.base_shapes, 64, roots=[tmp_path], default_source="local",
                         base_weight=tiny.base_weight)
    merged = asyncio.run(store.get_merged(MergeSpec(("rs", "plain"), weights, strategy, density)))
    assert {w.scale for w in merged.modules.values()} == {1.0}
    ((tokens, _),), _ = _run(tiny.engine, [(GREEDY_PROMPT, NEW_TOKENS, merged)])
    assert tokens == expected
    assert expected != tiny.base_tokens, "the merge does not change the greedy tokens"


@pytest.mark.parametrize("change", ["one_row_trained", "head_scaled", "vocabulary_resized"])
def test_changed_copy_of_the_output_head_is_refused(tiny: Tiny, tmp_path: pathlib.Path, change: str) -> None:
    model = peft_model(tiny.hf, seed=7, r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    model.save_pretrained(str(tmp_path))
    path = tmp_path / "adapter_model.safetensors"
    tensors = load_file(path)
    head = tensors[HEAD_COPY]
    torch.testing.assert_close(head, tiny.base_weight("lm_head"), atol=0, rtol=0)
    load_adapter_dir(tmp_path, "unchanged", tiny.engine.lora.base_shapes, 64, tiny.base_weight)  # the control

    if change == "one_row_trained":
        changed = head.clone()
        changed[17] += 0.5
    elif change == "head_scaled":
        changed = head * 2
    else:
        changed = torch.cat([head, torch.randn(8, head.shape[1]) * 0.02])
    save_file({**tensors, HEAD_COPY: changed}, str(path))
    with pytest.raises(AdapterInvalid, match=r"lm_head\.base_layer\.weight: a base-layer weight that differs"):
        load_adapter_dir(tmp_path, "changed", tiny.engine.lora.base_shapes, 64, tiny.base_weight)


# ---- the embedded SmolLM2-135M (tied embeddings: the head's weight is the embedding's) ----------------

EMBEDDED_PROMPT = "The old sailor looked at the sea and said that the ships"
EMBEDDED_NEW_TOKENS = 8
EMBEDDED_CASES = {
    "r16_all_projections": dict(r=16, lora_alpha=32, target_modules=ALL),
    "rslora_patterns_lm_head": dict(
        r=8, lora_alpha=16, use_rslora=True, target_modules=[*ALL, "lm_head"],
        rank_pattern={"q_proj": 16, "down_proj": 4}, alpha_pattern={"v_proj": 4}, strength=0.7,
    ),
}


@dataclass
class EmbeddedAdapters:
    peft: object  # one PEFT model, over a copy of embedded_hf, holding every case as a named adapter
    peft_names: dict[str, str]  # case -> PEFT adapter name
    adapters: dict  # case -> our LoraAdapter, read from what PEFT saved
    prompt: list[int]
    base_logits: torch.Tensor  # transformers, without adapter

    def select(self, case: str):
        self.peft.set_adapter(self.peft_names[case])
        return self.peft


@pytest.fixture(scope="module")
def embedded_adapters(embedded, embedded_hf, tmp_path_factory) -> EmbeddedAdapters:
    from loraplex.lora.device.table import AdapterTable

    # The shapes an engine checks adapters against (wrapping is idempotent and holds no adapter state).
    base_shapes = AdapterTable(embedded.model, 1, embedded.device, embedded.dtype).base_shapes
    cases = list(EMBEDDED_CASES)
    peft_names = {case: "default" if i == 0 else case for i, case in enumerate(cases)}
    model = peft_model(embedded_hf, seed=1, **EMBEDDED_CASES[cases[0]])
    for seed, case in enumerate(cases[1:], start=2):
        add_random_adapter(model, peft_names[case], seed=seed, **EMBEDDED_CASES[case])
    directory = tmp_path_factory.mktemp("embedded-adapters")
    adapters = {}
    for case in cases:
        adapters[case] = save_and_load(
            model, directory, f"embedded-{case}", base_shapes, name=peft_names[case],
            base_weight=lambda m: embedded.model.get_submodule(m).weight,
        )
        _assert_config_read_as_peft(adapters[case], model, base_shapes, peft_names[case])
    prompt = embedded.tokenizer.encode(EMBEDDED_PROMPT)
    assert 10 <= len(prompt) <= 20
    return EmbeddedAdapters(model, peft_names, adapters, prompt, reference_logits(embedded_hf, prompt))


@pytest.mark.parametrize("case", list(EMBEDDED_CASES))
def test_embedded_logits_match_peft(embedded, embedded_adapters: EmbeddedAdapters, case: str) -> None:
    e = embedded_adapters
    expected = reference_logits(e.select(case), e.prompt)
    got = full_logits(embedded.model, embedded.config, e.prompt, adapter=e.adapters[case])
    atol = _atol(expected)
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    assert (expected - e.base_logits).abs().max() > 100 * atol, "the adapter barely changes the logits"


def test_embedded_greedy_tokens_match_peft_in_one_batch(
    embedded_hf, embedded_adapters: EmbeddedAdapters, make_engine
) -> None:
    e = embedded_adapters
    cases = list(EMBEDDED_CASES)
    engine = make_engine(max_active_adapters=len(cases))
    requests = [(e.prompt, EMBEDDED_NEW_TOKENS, adapter) for adapter in [*(e.adapters[c] for c in cases), None]]
    results, first_step = _run(engine, requests)
    assert first_step == len(requests)
    for (tokens, logprobs), case in zip(results, [*cases, None]):
        reference = e.select(case) if case else embedded_hf  # one PEFT model: select, then use at once
        assert tokens == reference_greedy(reference, e.prompt, EMBEDDED_NEW_TOKENS), case
        _assert_logprobs_match(reference, e.prompt, tokens, logprobs)
    # Each adapter changes the output, from the first token on (sampled from the prefill's logits rows).
    assert len({tokens[0] for tokens, _ in results}) == len(results)
