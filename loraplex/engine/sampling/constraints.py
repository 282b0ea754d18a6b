"""A request's own restrictions of its next token, applied to its row before the penalties (as transformers' logits
processors and vLLM's are ordered): its logit bias (OpenAI's `logit_bias`, added to the raw logits, greedy rows
too), then the tokens it may not take: outside `allowed_token_ids`, completing one of its `bad_words`, or ending it
(EOS, stop token ids) before `min_tokens` are generated. Masked tokens are -inf, so no penalty or filter brings them
back. Only the rows that ask are touched; one request's bias or mask never reaches another row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.params import SamplingParams

_NEG_INF = float("-inf")


def constrains(params: SamplingParams) -> bool:
    """Whether `params` restrict or bias the next token (the row then never takes the plain-argmax path)."""
    return bool(params.logit_bias or params.allowed_token_ids or params.bad_words_ids
                or (params.min_tokens and params.min_tokens_stops))


def apply_constraints(
    x: torch.Tensor, original: torch.Tensor, params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """`x` [rows, V] with each row's bias added and its forbidden tokens at -inf (a copy when `x` is `original`)."""
    rows = [i for i, p in enumerate(params) if constrains(p)]
    if not rows:
        return x
    if x.data_ptr() == original.data_ptr():
        x = x.clone(memory_format=torch.contiguous_format)  # never edit the caller's logits
    vocab = x.shape[1]
    for i in rows:
        p, row = params[i], x[i]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=x.device)
            row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=x.dtype, device=x.device))
        banned = list(_bad_word_ends(p.bad_words_ids, output_ids[i], prompt_ids[i]))
        if p.min_tokens and len(output_ids[i]) < p.min_tokens:
            banned.extend(p.min_tokens_stops)
        if p.allowed_token_ids:
            keep = torch.full((vocab,), _NEG_INF, dtype=x.dtype, device=x.device)
            allowed = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=x.device)
            keep[allowed] = 0.0
            row.add_(keep)
        banned = [t for t in banned if 0 <= t < vocab]
        if banned:
            row[torch.tensor(banned, dtype=torch.long, device=x.device)] = _NEG_INF
    return x


def _bad_word_ends(bad_words: Sequence[Sequence[int]], output: Sequence[int], prompt: Sequence[int]):
    """The last token of each bad word whose other tokens the sequence (prompt, then output) ends with: taking it
    would complete the word (transformers' NoBadWordsLogitsProcessor; a one-token word is always banned)."""
    for word in bad_words:
        head = word[:-1]
        if not head:
            yield word[-1]
            continue
        if len(prompt) + len(output) < len(head):
            continue
        tail = list(output[-len(head):]) if len(output) >= len(head) else \
            [*prompt[len(prompt) - (len(head) - len(output)):], *output]
        if tail == list(head):
            yield word[-1]
