"""The edge's size limits, shared by the native and OpenAI routes: the engine's input processor checks
(engine/requests/inputs.py), its refusals said in the request's own field names; messages name the limit and its value.

Every list a request carries is counted against its flag (`check_count`) right after the request is parsed, before
any work per element (chat templates, tool grammars, images): counting is O(1) per list, so a request of a million
messages costs its parse and no more."""

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


def check_count(state: ServerState, param: str, count: int, setting: str) -> None:
    """`count` entries of the request's `param` within the ServerConfig `setting` that bounds them."""
    limit = getattr(state.config, setting)
    if count > limit:
        words, flag = setting.replace("_", " "), "--" + setting.replace("_", "-")
        raise BadRequest(f"{param} must have at most {limit} entries ({words}: {flag}); got {count}", param)


def check_token_ids(state: ServerState, param: str, ids) -> None:
    """Token ids the request names (e.g. stop_token_ids; counted by server/counted_route.py): each in the vocabulary."""
    vocab = state.tokenizer.vocab_size
    outside = next((i for i in ids if not 0 <= i < vocab), None)
    if outside is not None:
        raise BadRequest(f"{param} must be token ids in [0, {vocab}); got {outside}", param)
