"""The base of every request model (both APIs): what no field, at any depth, may hold.

Strings must be Unicode text the tokenizer can take: no lone surrogates (JSON's "\\ud800" escapes decode to
them, and they cannot be encoded as UTF-8) and no NUL characters. Numbers must be finite: pydantic accepts
NaN and Infinity for float fields unless told not to, and `Any` / `dict` fields (schemas, extras) hold
whatever the JSON held. Checked once here for every declared field and every extra one, so that no route
and no new field can skip it.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

# vLLM's _SAMPLING_EPS: a temperature below it is greedy (dividing the logits by it overflows them to NaN).
SAMPLING_EPS = 1e-5
# Repetition penalty (HF: positive logits divided by it, negative ones multiplied): outside this range the
# answer is degenerate, and tiny values round to 0 in float32 (a division by zero, NaN logprobs).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# JSON has no -inf or NaN: a logprob that is not finite (a masked token's -inf) is reported as this floor.
MIN_LOGPROB = -9999.0


def finite_logprob(value: float | None) -> float:
    """A logprob JSON can carry: None, -inf and NaN become MIN_LOGPROB."""
    if value is None or not math.isfinite(value):
        return MIN_LOGPROB
    return max(value, MIN_LOGPROB)


def unfit(value: Any, where: str = "") -> tuple[str, str] | None:
    """(where, why) for the first string that is not text or number that is not finite in `value`, walking
    lists and dicts (keys too; iteratively: any depth JSON can nest to); None when all is well. Nested
    models check themselves."""
    stack = [(where, value)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                return where, "must not contain NUL characters (\\u0000)"
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where, "must be valid Unicode text: lone surrogates (\\ud800-\\udfff) are not characters"
        elif isinstance(value, float) and not math.isfinite(value):
            return where, "must be a finite number"
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                stack += [(f"{where}.{key}", item), (f"{where}.{key!r}", key)]
        elif isinstance(value, (list, tuple)):
            stack += [(f"{where}[{i}]", item) for i, item in reversed(list(enumerate(value)))]
    return None


def _refuse(found: tuple[str, str] | None, field: str = "") -> None:
    if found:
        where, why = found
        where = f"{field}{where}".lstrip(".")
        raise ValueError(f"{where} {why}" if where else why)


class RequestModel(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _fit(cls, value: Any, info: ValidationInfo) -> Any:
        # The error's location already names the field; the message names the part inside it.
        found = unfit(value)
        if found:
            _refuse((f"{info.field_name}{found[0]}", found[1]))
        return value

    @model_validator(mode="after")
    def _fit_extras(self) -> Any:
        """Extra fields (models with extra="allow") are passed on, so they are checked too."""
        for name, value in (self.__pydantic_extra__ or {}).items():
            _refuse(unfit(value), name)
        return self
