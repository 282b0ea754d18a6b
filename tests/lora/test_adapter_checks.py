"""What an adapter must satisfy at load: finite factors and scales within the documented bounds (merges
too), config fields of the right type, and tenant regexes that cannot stall the server. Each refusal is
an AdapterInvalid naming the tensor or field."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
import torch

from loraplex.lora.adapter import (
    ADAPTER_CONFIG,
    MAX_LORA_WEIGHT,
    AdapterInvalid,
    LoraAdapter,
    LoraConfig,
    LoraWeights,
    load_adapter_dir,
)
from loraplex.lora.lora_config import MAX_LORA_SCALE
from loraplex.lora.merge import merge_adapters
from loraplex.lora.patterns import FALLBACK_BUDGET_S
from tests.lora.test_store import BASE, MAX_RANK, P, lora_tensors, write_adapter

TENSOR = f"{P}model.layers.1.self_attn.v_proj.lora_B.weight"
A_TENSOR = f"{P}model.layers.0.self_attn.q_proj.lora_A.weight"


def load(path):
    return load_adapter_dir(path, "a", BASE, MAX_RANK)


def poisoned(key: str, value: float) -> dict[str, torch.Tensor]:
    tensors = lora_tensors()
    tensors[key] = tensors[key].clone()
    tensors[key][1, 2] = value
    return tensors


@pytest.mark.parametrize("key", [TENSOR, A_TENSOR], ids=["B", "A"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_factors_are_refused_naming_the_tensor(tmp_path, key, value):
    write_adapter(tmp_path / "a", tensors=poisoned(key, value))
    with pytest.raises(AdapterInvalid, match="NaN or infinite") as info:
        load(tmp_path / "a")
    assert key in str(info.value)


@pytest.mark.parametrize("key", [TENSOR, A_TENSOR], ids=["B", "A"])
def test_factors_beyond_the_bound_are_refused_and_at_the_bound_served(tmp_path, key):
    write_adapter(tmp_path / "huge", tensors=poisoned(key, -2 * MAX_LORA_WEIGHT))
    with pytest.raises(AdapterInvalid, match="beyond the bound") as info:
        load(tmp_path / "huge")
    assert key in str(info.value)
    write_adapter(tmp_path / "edge", tensors=poisoned(key, MAX_LORA_WEIGHT))
    assert load(tmp_path / "edge").modules


@pytest.mark.parametrize(
    "config, field",
    [
        ({"lora_alpha": math.nan}, "lora_alpha"),
        ({"lora_alpha": math.inf}, "lora_alpha"),
        ({"lora_alpha": -math.inf}, "lora_alpha"),
        ({"lora_alpha": 1e300}, "lora_alpha"),
        ({"lora_alpha": 10**400}, "lora_alpha"),
        ({"lora_alpha": 4 * MAX_LORA_SCALE * 4 + 1}, "lora_alpha"),  # r=4: alpha / r just past the bound
        ({"alpha_pattern": {"v_proj": math.nan}}, "alpha_pattern['v_proj']"),
        ({"alpha_pattern": {"v_proj": 1e300}}, "alpha_pattern['v_proj']"),
        ({"lora_alpha": 20, "use_rslora": True, "rank_pattern": {"q_proj": 1}, "alpha_pattern": {"q_proj": 2e3}},
         "alpha_pattern['q_proj']"),
    ],
)
def test_scales_that_are_not_finite_or_beyond_the_bound_are_refused(tmp_path, config, field):
    path = write_adapter(tmp_path / "a")
    # json writes NaN and Infinity as Python reads them back (and as a hostile config would hold them).
    (path / ADAPTER_CONFIG).write_text(json.dumps({**json.loads((path / ADAPTER_CONFIG).read_text()), **config}))
    with pytest.raises(AdapterInvalid) as info:
        load(path)
    assert field in str(info.value)


def test_the_largest_scale_within_the_bound_is_served(tmp_path):
    path = write_adapter(tmp_path / "a", config={"lora_alpha": 4 * MAX_LORA_SCALE})  # r = 4
    assert {w.scale for w in load(path).modules.values()} == {MAX_LORA_SCALE}


# ---- wrongly typed fields: each a refusal naming the field, never a crash --------------------------


@pytest.mark.parametrize(
    "config, field",
    [
        ({"lora_alpha": "x"}, "lora_alpha"),
        ({"lora_alpha": None}, "lora_alpha"),
        ({"lora_alpha": [16]}, "lora_alpha"),
        ({"lora_alpha": True}, "lora_alpha"),
        ({"target_modules": 5}, "target_modules"),
        ({"target_modules": "("}, "target_modules"),
        ({"target_modules": ["q_proj", 3]}, "target_modules"),
        ({"rank_pattern": "abc"}, "rank_pattern"),
        ({"rank_pattern": {"(": 8}}, "rank_pattern['(']"),
        ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern['q_proj']"),
        ({"alpha_pattern": [1, 2]}, "alpha_pattern"),
        ({"layers_pattern": 5}, "layers_pattern"),
        ({"exclude_modules": 5}, "exclude_modules"),
        ({"layers_to_transform": ["0"]}, "layers_to_transform"),
        ({"use_rslora": "false"}, "use_rslora"),
        ({"r": 2.5}, "r"),
    ],
)
def test_wrongly_typed_fields_are_refused_naming_the_field(config, field):
    raw = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **config}
    with pytest.raises(AdapterInvalid) as info:
        LoraConfig.from_dict(raw, MAX_RANK)
    assert str(info.value).startswith(field)


def test_a_config_nested_too_deeply_or_too_large_is_refused(tmp_path):
    path = write_adapter(tmp_path / "deep")
    (path / ADAPTER_CONFIG).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(AdapterInvalid, match="nested too deeply"):
        load(path)
    (path / ADAPTER_CONFIG).write_text(json.dumps({"r": 4, "padding": "x" * (1 << 20)}))
    with pytest.raises(AdapterInvalid, match="larger than"):
        load(path)


# ---- merges -----------------------------------------------------------------------------------------


def adapter(adapter_id: str, b_value: float | None = None, scale: float = 2.0) -> LoraAdapter:
    g = torch.Generator().manual_seed(len(adapter_id))
    modules = {}
    for module, (fan_in, fan_out) in BASE.items():
        b = torch.randn(fan_out, 4, generator=g) * 0.1
        if b_value is not None:
            b[0, 0] = b_value
        modules[module] = LoraWeights(torch.randn(4, fan_in, generator=g) * 0.1, b, scale)
    return LoraAdapter(adapter_id, modules, LoraConfig(r=4, lora_alpha=4 * scale, target_modules=("q_proj", "v_proj")))


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_merge_that_would_hold_non_finite_values_is_refused(value):
    # The bad part bypassed the load check (built in memory): the merge's own check still catches it.
    with pytest.raises(AdapterInvalid, match="NaN or infinite"):
        merge_adapters("m", [adapter("good"), adapter("bad", b_value=value)], [0.5, 0.5])


def test_a_merge_whose_weights_push_factors_past_the_bound_is_refused_naming_the_module():
    good = [adapter("one"), adapter("two")]
    assert merge_adapters("m", good, [1.0, 1.0]).modules
    with pytest.raises(AdapterInvalid, match="merge's model.layers.0.self_attn.q_proj.*beyond the bound"):
        merge_adapters("m", good, [1e12, 1.0])


# ---- tenant regexes -------------------------------------------------------------------------------


def test_a_catastrophic_regex_is_matched_in_linear_time(tmp_path):
    path = write_adapter(tmp_path / "a", config={"target_modules": "mode(.|.)*Z"})
    started = time.perf_counter()
    with pytest.raises(AdapterInvalid, match="not in the config's target_modules"):
        load(path)
    assert time.perf_counter() - started < 0.5


def test_a_backtracking_only_regex_is_bounded_and_does_not_hold_the_interpreter(tmp_path):
    """A lookahead forces the backtracking engine: it must stop at its budget, and other threads must
    keep running meanwhile (the event loop and the engine live in this process too)."""
    path = write_adapter(tmp_path / "a", config={"target_modules": "(?=m)mode(.|.)*Z"})
    ticks = []
    done = threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.005)

    thread = threading.Thread(target=ticker)
    thread.start()
    started = time.perf_counter()
    try:
        with pytest.raises(AdapterInvalid, match="target_modules: the regex .* took more than"):
            load(path)
    finally:
        done.set()
        thread.join()
    elapsed = time.perf_counter() - started
    assert FALLBACK_BUDGET_S * 0.5 < elapsed < FALLBACK_BUDGET_S + 0.5
    assert len(ticks) > 10 and max(b - a for a, b in zip(ticks, ticks[1:])) < 0.1  # never blocked long


def test_lookaround_patterns_still_match_as_python_would():
    config = LoraConfig.from_dict(
        {"r": 4, "lora_alpha": 8, "target_modules": r"^(?!.*layers\.1\.).*\.(q_proj|v_proj)$",
         "rank_pattern": {r"(?<=0\.self_attn\.)q_proj": 2}},
        MAX_RANK,
    )
    assert [m for m in BASE if config.targets(m)] == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    assert config.rank("model.layers.0.self_attn.q_proj") == 2 and config.rank("model.layers.1.self_attn.q_proj") == 4


def test_an_overlong_regex_is_refused():
    with pytest.raises(AdapterInvalid, match="target_modules: the regex is 5000 characters long"):
        LoraConfig.from_dict({"r": 4, "target_modules": "a" * 5000}, MAX_RANK)
