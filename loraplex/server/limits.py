"""The edge's size limits, shared by the native and OpenAI routes; messages name the limit and its value."""

from __future__ import annotations

from loraplex.server.errors import BadRequest
from loraplex.server.state import ServerState


def check_prompt_and_budget(
    state: ServerState, prompt_ids: list[int], max_new_tokens: int, prompt_field: str, max_new_field: str
) -> None:
    if not prompt_ids:
        raise BadRequest(f"{prompt_field} must not be empty (it has no tokens)", prompt_field)
    max_input = state.core.config.max_input_length
    if len(prompt_ids) > max_input:
        raise BadRequest(
            f"{prompt_field} must have at most {max_input} tokens (max input length); got {len(prompt_ids)}",
            prompt_field,
        )
    max_total = state.core.max_total_tokens
    in_sequence = state.core.sequence_tokens_of_prompt(len(prompt_ids))
    if in_sequence + max_new_tokens > max_total:
        what = f"{prompt_field} tokens" if in_sequence == len(prompt_ids) else "the decoder's start token"
        raise BadRequest(
            f"{what} + {max_new_field} must be <= {max_total} (max total tokens); got {in_sequence} + {max_new_tokens}",
            max_new_field,
        )


def check_stop_sequences(state: ServerState, num_stops: int) -> None:
    limit = state.config.max_stop_sequences
    if num_stops > limit:
        raise BadRequest(f"stop must have at most {limit} sequences (max stop sequences); got {num_stops}", "stop")
