"""The adapter workload: loraplex serving many LoRA adapters at once, against PEFT's mixed-adapter batch.

Four systems, timed in one run (they take turns; each keeps its best time):

1. loraplex with adapters: the requests spread round-robin over N adapters, all submitted at once
   (the engine has a device slot for each adapter).
2. loraplex on the base model: the same requests without adapters (what the adapters cost).
3. PEFT's mixed-adapter batch: one `generate` over all rows, `adapter_names` naming each row's adapter.
4. loraplex rotating adapters: more adapters than device slots (one request per adapter), so adapters take
   turns in the slots (`adapter_cycle_time_s`); its rate is compared with (1). With one request per adapter at
   most `slots` requests run at once, so its rate also pays for smaller batches (and a prefill per wave),
   not only for the installs.

The adapters of (1)-(3) are made once with PEFT on the transformers model (random A and B, seeded) and converted
to loraplex's form from PEFT's own state dict and config, so both systems run identical weights; (1)'s greedy
tokens are checked against PEFT's. The rotation adapters (4) are drawn directly with PEFT's initialisation for
`init_lora_weights=False` (nn.Linear's default: uniform within 1/sqrt(fan_in)), seeded.
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter

import torch

from benchmarks.peers import left_padded
from benchmarks.workload import Workload
from loraplex.lora.adapter import (
    BaseShapes,
    LoraAdapter,
    LoraConfig,
    adapter_from_tensors,
)

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = TARGET_MODULES

    def describe(self) -> str:
        short = ",".join(t.removesuffix("_proj") for t in self.targets)
        return f"rank {self.rank}, alpha {self.alpha:g}, on {short}"


# ---- adapters ---------------------------------------------------------------------------------------


def make_peft_model(hf_model, names: Sequence[str], spec: AdapterSpec, seed: int = 0):
    """Wrap `hf_model` (modified in place) in a PeftModel holding one random adapter per name, B non-zero."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    def config() -> PeftLoraConfig:
        return PeftLoraConfig(
            r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0,
            init_lora_weights=False,
        )

    torch.manual_seed(seed)
    with warnings.catch_warnings():  # transformers' deprecation notice about gradient checkpointing, not ours
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(hf_model, config(), adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, config())
    return peft_model.eval()


def _plain(value):
    """A value of PEFT's config dict as adapter_config.json holds it (sets as lists, enums as their value)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def adapter_from_peft(peft_model, name: str, base_shapes: BaseShapes, max_rank: int) -> LoraAdapter:
    """loraplex's adapter from PEFT's own state dict and config of adapter `name` (what save_pretrained writes)."""
    from peft.utils import get_peft_model_state_dict

    raw = {key: _plain(value) for key, value in peft_model.peft_config[name].to_dict().items()}
    config = LoraConfig.from_dict(raw, max_rank)
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model, adapter_name=name).items()}
    return adapter_from_tensors(name, config, tensors, base_shapes)


def random_adapter(
    adapter_id: str, base_shapes: BaseShapes, spec: AdapterSpec, max_rank: int, seed: int
) -> LoraAdapter:
    """A random adapter drawn as PEFT's init_lora_weights=False draws it, through the adapter_config path."""
    config = LoraConfig.from_dict(
        {"r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.targets)}, max_rank
    )
    g = torch.Generator().manual_seed(seed)

    def uniform(rows: int, cols: int) -> torch.Tensor:  # nn.Linear's default init of a [rows, cols] weight
        bound = 1 / math.sqrt(cols)
        return (torch.rand(rows, cols, generator=g) * 2 - 1) * bound

    tensors = {}
    for module, (in_features, out_features) in base_shapes.items():
        if config.targets(module):
            tensors[f"base_model.model.{module}.lora_A.weight"] = uniform(spec.rank, in_features)
            tensors[f"base_model.model.{module}.lora_B.weight"] = uniform(out_features, spec.rank)
    return adapter_from_tensors(adapter_id, config, tensors, base_shapes)


# ---- peers ------------------------------------------------------------------------------------------


class PEFTMixed:
    """PEFT's mixed-adapter batch: all requests as one left-padded batch, each row on its own adapter
    (`adapter_names`). Like transformers batched, every row generates max(max_new_tokens) tokens."""

    name = "PEFT mixed-adapter batch"

    def __init__(self, peft_model, pad_token_id: int = 0) -> None:
        self.model, self.pad_token_id = peft_model, pad_token_id

    def run(self, workload: Workload) -> list[list[int]]:
        assert workload.adapter_ids is not None, "PEFTMixed needs a workload with adapters"
        input_ids, attention_mask = left_padded(workload.prompts, self.pad_token_id)
        steps = max(workload.max_new_tokens)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, adapter_names=list(workload.adapter_ids),
                do_sample=False, max_new_tokens=steps, min_new_tokens=steps, pad_token_id=self.pad_token_id,
                temperature=None, top_p=None, top_k=None,
            )
        return [row[:n].tolist() for row, n in zip(out[:, input_ids.shape[1]:], workload.max_new_tokens)]


# ---- the benchmark ----------------------------------------------------------------------------------

# Targets: loraplex with adapters as a multiple of PEFT mixed, and of loraplex on the base model.
TARGETS = {"peft_mixed": 1.5, "base": 0.85}


@dataclass
class Timed:
    """One system's best run: seconds, useful output tokens and the engine's step statistics (loraplex only)."""

    system: str
    seconds: float
    requests: int
    tokens: int
    stats: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def to_json(self) -> dict:
        return {"system": self.system, "seconds": self.seconds, "requests": self.requests, "tokens": self.tokens,
                "tokens_per_s": self.tokens_per_s, **self.stats}


@dataclass
class AdapterResult:
    workload: Workload
    rotation_workload: Workload
    spec: AdapterSpec
    rotation_slots: int
    adapters: Timed  # (1)
    base: Timed  # (2)
    peft: Timed  # (3)
    rotation: Timed  # (4)
    identical_to_peft: int  # requests whose greedy tokens under loraplex with adapters equal PEFT's
    differ_from_base: int  # requests whose tokens with their adapter differ from the base model's (adapters bite)
    repeats: int = 1

    @property
    def ratios(self) -> dict[str, float]:
        rate = self.adapters.tokens_per_s
        return {
            "peft_mixed": rate / self.peft.tokens_per_s,
            "base": rate / self.base.tokens_per_s,
            "rotation_vs_adapters": self.rotation.tokens_per_s / rate,
        }

    def to_json(self) -> dict:
        w, r = self.workload, self.rotation_workload
        return {
            "description": w.describe(),
            "seed": w.seed,
            "adapter": {"rank": self.spec.rank, "alpha": self.spec.alpha, "target_modules": list(self.spec.targets)},
            "num_adapters": w.num_adapters,
            "prompt_lengths": [len(p) for p in w.prompts],
            "max_new_tokens": w.max_new_tokens,
            "loraplex_adapters": self.adapters.to_json(),
            "loraplex_base": self.base.to_json(),
            "peft_mixed": self.peft.to_json(),
            "rotation": self.rotation.to_json() | {
                "description": r.describe(), "num_adapters": r.num_adapters, "max_active_adapters": self.rotation_slots,
            },
            "ratios": self.ratios,
            "targets": TARGETS,
            "identical_to_peft": [self.identical_to_peft, self.workload.num_requests],
            "differ_from_base": [self.differ_from_base, self.workload.num_requests],
            "repeats": self.repeats,
        }


def _timed(system, workload: Workload) -> tuple[Timed, list[list[int]]]:
    start = perf_counter()
    outputs = system.run(workload)
    seconds = perf_counter() - start
    counts = [len(o) for o in outputs]
    if counts != workload.max_new_tokens:  # every request finished, with all its tokens
        raise RuntimeError(f"{system.name} generated {counts} tokens; asked for {workload.max_new_tokens}")
    stats = dict(getattr(system, "stats", {}))
    return Timed(system.name, seconds, workload.num_requests, sum(counts), stats), outputs


def bench_adapters(
    workload: Workload, rotation_workload: Workload, adapters, base, peft, rotation, spec: AdapterSpec,
    rotation_slots: int, repeats: int = 1, log: Callable[[str], None] = lambda line: None,
) -> AdapterResult:
    """Time the four systems (taking turns `repeats` times; each keeps its best run) and compare tokens.
    `log` gets a line after each timed run (progress: the whole takes a while on CPU)."""
    runs = [(adapters, workload), (base, workload), (peft, workload), (rotation, rotation_workload)]

    def timed(system, w: Workload, round_: int):
        result = _timed(system, w)
        log(f"  [round {round_ + 1}/{repeats}] {system.name}: {result[0].seconds:.1f}s, "
            f"{result[0].tokens_per_s:.2f} tok/s")
        return result

    rounds = [[timed(system, w, i) for system, w in runs] for i in range(repeats)]
    best = [min(column, key=lambda r: r[0].seconds) for column in zip(*rounds)]
    (ours_t, ours_out), (base_t, base_out), (peft_t, peft_out), (rot_t, _) = best
    identical = sum(a == b for a, b in zip(ours_out, peft_out))
    differ = sum(a != b for a, b in zip(ours_out, base_out))
    return AdapterResult(workload, rotation_workload, spec, rotation_slots, ours_t, base_t, peft_t, rot_t,
                         identical, differ, repeats)


def format_adapter_result(result: AdapterResult, setting: str) -> str:
    w, r = result.workload, result.rotation_workload
    best_of = f", best of {result.repeats}" if result.repeats > 1 else ""
    ratios = result.ratios

    def row(t: Timed, label: str, tail: str = "") -> str:
        return f"  {label:<36}{t.tokens_per_s:>9.1f} tok/s{tail}"

    def verdict(key: str) -> str:
        target = TARGETS[key]
        return f" (target >= {target:.2f}x, {'met' if ratios[key] >= target else 'NOT met'})"

    def installs(t: Timed) -> str:
        s = t.stats
        return (f"{s.get('installs', 0)} slot installs, {s.get('steps', 0)} steps, "
                f"at most {s.get('max_running', 0)} requests in a step")

    n = w.num_requests
    lines = [
        f"workload {w.name}: {w.describe()} ({result.spec.describe()}), greedy, {setting}{best_of}",
        row(result.adapters, f"loraplex, {w.num_adapters} adapters"),
        row(result.base, "loraplex, base model", f"   loraplex with adapters = {ratios['base']:.2f}x{verdict('base')}"),
        row(result.peft, result.peft.system,
            f"   loraplex with adapters = {ratios['peft_mixed']:.2f}x{verdict('peft_mixed')}"),
        row(result.rotation, f"loraplex, {r.num_adapters} adapters / {result.rotation_slots} slots",
            f"   = {ratios['rotation_vs_adapters']:.2f}x loraplex with {w.num_adapters} adapters"),
        f"  rotation: {r.describe()}, one request per adapter; {installs(result.rotation)}; every request finished",
        f"  loraplex with adapters: {installs(result.adapters)} (adapters resident since the warm-up)",
        (f"  sanity: {result.identical_to_peft}/{n} requests' greedy tokens identical to PEFT's; "
         f"{result.differ_from_base}/{n} differ from the base model's (the adapters change the output)"),
    ]
    return "\n".join(lines)
