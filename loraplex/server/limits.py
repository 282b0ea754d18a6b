"""The edge's size limits, shared by the native and OpenAI routes: the engine's input processor checks
(engine/requests/inputs.py), its refusals said in the request's own field names; messages name the limit and its value."""

from __future__ import annotations

from loraplex.engine.requests.inputs import PromptEmpty, PromptTooLong, SequenceTooLong
from loraplex.server.errors import BadRequest
from loraplex.server.state import ServerState


def check_prompt_and_budget(
    state: ServerState, prompt_ids: list[int], max_new_tokens: int, prompt_field: str, max_new_field: str
) -> None:
    try:
        state.model.limits.check_lengths(len(prompt_ids), max_new_tokens)
    except PromptEmpty:
        raise BadRequest(f"{prompt_field} must not be empty (it has no tokens)", prompt_field) from None
    except PromptTooLong as refused:
        raise BadRequest(
            f"{prompt_field} must have at most {refused.limit} tokens (max input length); got {refused.num_tokens}",
            prompt_field,
        ) from None
    except SequenceTooLong as refused:
        what = "the decoder's start token" if refused.decoder_start else f"{prompt_field} tokens"
        raise BadRequest(
            f"{what} + {max_new_field} must be <= {refused.limit} (max total tokens); "
            f"got {refused.in_sequence} + {refused.max_new_tokens}",
            max_new_field,
        ) from None


def check_stop_sequences(state: ServerState, num_stops: int) -> None:
    limit = state.config.max_stop_sequences
    if num_stops > limit:
        raise BadRequest(f"stop must have at most {limit} sequences (max stop sequences); got {num_stops}", "stop")
