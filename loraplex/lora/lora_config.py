"""The parts of a PEFT adapter's `adapter_config.json` that decide which modules get a delta and how it is scaled,
read exactly as PEFT applies them (lora/adapter.py reads the weights). What we do not serve is refused, naming the
field."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import loraplex.lora.config_fields as fields
from loraplex.lora.errors import AdapterInvalid
from loraplex.lora.patterns import MatchBudget, UserPattern

MAX_LORA_SCALE = 1e3  # largest |alpha / r| (or |alpha / sqrt(r)| with rsLoRA); see lora/adapter.py's bounds

_DEFAULT_LAYER_INDEX = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")


def check_scale(scale: float, name: str) -> None:
    if not abs(scale) <= MAX_LORA_SCALE:
        raise AdapterInvalid(f"{name}: the LoRA scale alpha / r = {scale:g} is beyond the bound {MAX_LORA_SCALE:g}")


# Options PEFT offers that change what the adapter computes and that we do not serve:
# field -> (value that means "off", what to say).
_UNSERVED_OPTIONS: dict[str, tuple[Any, str]] = {
    "use_dora": (False, "DoRA (use_dora) is not served"),
    "modules_to_save": (None, "modules_to_save (fully fine-tuned modules) is not served"),
    "lora_bias": (False, "lora_bias is not served"),
    "trainable_token_indices": (None, "trainable_token_indices is not served"),
    "layer_replication": (None, "layer_replication is not served"),
    "alora_invocation_tokens": (None, "aLoRA (alora_invocation_tokens) is not served"),
    "megatron_config": (None, "megatron_config is not served"),
}


@dataclass(frozen=True)
class LoraConfig:
    """The parts of a PEFT `LoraConfig` that decide which modules get a delta and how it is scaled."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] = ()
    exclude_modules: tuple[str, ...] | str = ()
    target_parameters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Tenant-written regexes, compiled once; all of one config's backtracking matches share a budget.
        budget = MatchBudget()

        def compile_(source: str, name: str) -> UserPattern:
            return UserPattern(source, name, budget)

        patterns = {
            "targets": compile_(self.target_modules, "target_modules") if isinstance(self.target_modules, str) else None,
            "exclude": compile_(self.exclude_modules, "exclude_modules") if isinstance(self.exclude_modules, str) else None,
            "rank": [(k, compile_(rf"(.*\.)?({k})$", f"rank_pattern[{k!r}]")) for k in self.rank_pattern],
            "alpha": [(k, compile_(rf"(.*\.)?({k})$", f"alpha_pattern[{k!r}]")) for k in self.alpha_pattern],
            "layers": [compile_(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", "layers_pattern") for p in self.layers_pattern],
        }
        object.__setattr__(self, "_patterns", patterns)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], max_rank: int) -> "LoraConfig":
        """Read an adapter_config.json; refuse what we do not serve, what exceeds `max_rank`, and
        fields of the wrong type or out of bounds (naming the field)."""
        peft_type = str(raw.get("peft_type", "LORA")).upper().removeprefix("PEFTTYPE.")  # str(PeftType.LORA)
        if peft_type != "LORA":
            raise AdapterInvalid(f"peft_type {raw.get('peft_type')!r} is not served; only LORA adapters are")
        for name, (off, message) in _UNSERVED_OPTIONS.items():
            value = raw.get(name, off)
            if value not in (off, None, False, [], {}):
                raise AdapterInvalid(f"{message} ({name}={value!r})")
        if raw.get("bias", "none") != "none":
            raise AdapterInvalid(f"bias={raw.get('bias')!r} is not served; only bias='none' is")
        r = fields.positive_int(raw.get("r", 8), "r")
        rank_pattern = {k: fields.positive_int(v, f"rank_pattern[{k!r}]") for k, v in fields.mapping(raw, "rank_pattern").items()}
        alpha_pattern = {k: fields.alpha(v, f"alpha_pattern[{k!r}]") for k, v in fields.mapping(raw, "alpha_pattern").items()}
        for name, rank in [("r", r), *((f"rank_pattern[{k!r}]", v) for k, v in rank_pattern.items())]:
            if rank > max_rank:
                raise AdapterInvalid(f"{name} = {rank} is above the maximum LoRA rank {max_rank} (--max-lora-rank)")
        layers = raw.get("layers_to_transform")
        if layers is not None:
            layers = fields.int_list(layers, "layers_to_transform")
        use_rslora = raw.get("use_rslora", False)
        if not isinstance(use_rslora, bool):
            raise AdapterInvalid(f"use_rslora must be true or false; got {use_rslora!r}")
        config = cls(
            r=r,
            lora_alpha=fields.alpha(raw.get("lora_alpha", 8), "lora_alpha"),
            use_rslora=use_rslora,
            target_modules=fields.names_or_regex(raw, "target_modules"),
            rank_pattern=rank_pattern,
            alpha_pattern=alpha_pattern,
            layers_to_transform=layers,
            layers_pattern=fields.names(raw, "layers_pattern"),
            exclude_modules=fields.names_or_regex(raw, "exclude_modules"),
            target_parameters=fields.parameter_names(raw),
        )
        smallest_rank = min([r, *rank_pattern.values()])
        for alpha, name in [(config.lora_alpha, "lora_alpha"), *((v, f"alpha_pattern[{k!r}]") for k, v in alpha_pattern.items())]:
            check_scale(config._scale_of(abs(alpha), smallest_rank), name)  # the largest scale it can give
        return config

    # ---- as PEFT applies it ----------------------------------------------------------------------

    def targets(self, module: str) -> bool:
        """Whether PEFT would put a LoRA on `module` (its name in the base model)."""
        if self._excluded(module):
            return False
        if self._patterns["targets"] is not None:  # a regex: matched whole, layers_to_transform not applied
            return self._patterns["targets"].fullmatch(module)
        if module in self.target_modules:
            return True
        if not any(module.endswith(f".{t}") for t in self.target_modules):
            return False
        if not self.layers_to_transform:
            return True
        index = self._layer_index(module)
        return index is not None and index in self.layers_to_transform

    def targets_parameter(self, parameter: str) -> bool:
        """Whether PEFT would put a LoRA on `parameter` (module name + parameter name) by `target_parameters`."""
        return any(parameter == t or parameter.endswith(f".{t}") for t in self.target_parameters)

    def rank(self, module: str) -> int:
        return self.rank_pattern.get(self._pattern_key("rank", module), self.r)

    def scale(self, module: str) -> float:
        alpha = self.alpha_pattern.get(self._pattern_key("alpha", module), self.lora_alpha)
        return self._scale_of(alpha, self.rank(module))

    def _scale_of(self, alpha: float, rank: int) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def _excluded(self, module: str) -> bool:
        if self._patterns["exclude"] is not None:
            return self._patterns["exclude"].fullmatch(module)
        return module in self.exclude_modules or any(module.endswith(f".{e}") for e in self.exclude_modules)

    def _pattern_key(self, kind: str, module: str) -> str:
        """The first pattern that matches the end of `module` (after a dot), as PEFT picks it."""
        for key, pattern in self._patterns[kind]:
            if pattern.match(module):
                return key
        return module

    def _layer_index(self, module: str) -> int | None:
        """The first numbered segment of a module name (the layer index), as PEFT finds it."""
        if not self.layers_pattern:
            match = _DEFAULT_LAYER_INDEX.match(module)
        else:
            match = None
            for pattern in self._patterns["layers"]:
                match = pattern.match(module)
                if match is not None:
                    break
        return int(match.group("idx")) if match else None
