"""The fields of an adapter_config.json, read one by one: each value checked for its type, refused by name
(AdapterInvalid) when it is not what PEFT writes."""

from __future__ import annotations

import math
from typing import Any, Mapping

from loraplex.lora.errors import AdapterInvalid


def positive_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise AdapterInvalid(f"{name} must be a positive integer; got {value!r}")
    return value


def alpha(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AdapterInvalid(f"{name} must be a number; got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an integer too large for a float
        raise AdapterInvalid(f"{name} = {value} is out of bounds") from None
    if not math.isfinite(value):
        raise AdapterInvalid(f"{name} must be finite; got {value!r}")
    return value


def mapping(raw: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise AdapterInvalid(f"{name} must be an object (pattern -> value); got {value!r}")
    return value


def names(raw: Mapping[str, Any], name: str) -> tuple[str, ...]:
    value = raw.get(name) or ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise AdapterInvalid(f"{name} must be a string or a list of strings; got {value!r}")
    return tuple(value)


def names_or_regex(raw: Mapping[str, Any], name: str) -> tuple[str, ...] | str:
    """A string is a regex (PEFT's rule); a list names modules."""
    value = raw.get(name) or ()
    return value if isinstance(value, str) else names(raw, name)


def parameter_names(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """target_parameters: a list of names (PEFT takes no regex here)."""
    value = raw.get("target_parameters") or ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise AdapterInvalid(f"target_parameters must be a list of parameter names; got {value!r}")
    return tuple(value)


def int_list(value: Any, name: str) -> tuple[int, ...]:
    values = [value] if isinstance(value, int) else value
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise AdapterInvalid(f"{name} must be an integer or a list of integers; got {value!r}")
    return tuple(values)
