"""Batched, seeded sampling for one heterogeneous batch (every row has its own SamplingParams).

Pipeline per row, in the order Hugging Face transformers applies it:

    logit bias and the request's masks (constraints.py) -> repetition penalty (prompt + generated ids)
    -> frequency / presence penalties (generated ids)
    -> temperature -> [reported logprobs taken here] -> top_k -> top_p -> min_p -> typical_p -> draw

Greedy rows take the argmax after the penalties. A sampled row's draw is a pure function of its own
filtered logits and a key mixed from (seed, step = len(output_ids)): never of the other rows of the
batch or of its position in it, so a preempted request that is recomputed draws the same tokens.

The draw is an exponential race, ``argmax(p_i / E_i)`` with E_i ~ Exp(1), in two levels (first a block of
256 tokens by its mass, then a token inside it), so a row needs ~V/256 + 256 random numbers instead of V.
The noise comes from a per-row CPU torch.Generator seeded with the key, whatever the logits' device, so a
seed draws the same tokens on CPU and GPU. Unlike inverse-CDF sampling, whose cumulative sums move every
boundary when the logits move by a rounding error, a race only changes its winner when the top two
scores are within that error: batched and unbatched logits that differ in the last bits still agree.

Row reductions whose result depends on the batch shape are avoided (on CPU ``sum``/``logsumexp`` do;
softmax, log_softmax, amax, argmax, topk, sort and CPU cumsum do not). CUDA's cumsum kernels depend on
the batch shape, so there a top-p / typical-p cut-off or a block mass can differ in the last bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from loraplex.engine.sampling.constraints import apply_constraints
from loraplex.params import SamplingParams

# top_p / typical_p first look for the cut-off among a row's best few tokens (a cheap topk) and only
# fall back to a full sort of the vocabulary for rows whose cut-off lies further out.
_PREFIX_SIZES = (128, 2048)
# token_scores materialises log_softmax for this many rows at a time (bounds memory for long prompts).
_LOGPROB_CHUNK = 256

# Tokens per block of the two-level race (about sqrt(V) for V ~ 50k).
_RACE_BLOCK = 256

_MASK64 = (1 << 64) - 1
_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    token_ids: list[int]  # chosen token per row
    logprobs: list[float]  # logprob of the chosen token per row
    top_tokens: list[list[tuple[int, float]]]  # per row: top `top_n_tokens` (id, logprob), best first


class Sampler:
    """Samples one token per row of a batch of logits, each row with its own parameters.

    Reported logprobs (the chosen token's and ``top_tokens``) are ``log_softmax`` of the logits after the
    penalties and the temperature, *before* the top-k / top-p / min-p / typical-p filters: the model's
    view of the token, as TGI and OpenAI report it, not the truncated sampling distribution.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
    ) -> SamplerOutput:
        n = logits.shape[0]
        if not (len(params) == len(prompt_ids) == len(output_ids) == len(seeds) == n):
            raise ValueError("logits, params, prompt_ids, output_ids and seeds must have one entry per row")
        if n == 0:
            return SamplerOutput(token_ids=[], logprobs=[], top_tokens=[])
        device = logits.device

        x = apply_constraints(logits.float(), logits, params, prompt_ids, output_ids)
        x = _apply_penalties(x, logits, params, prompt_ids, output_ids)
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            x = x / torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1)
        logp = torch.log_softmax(x, dim=1)

        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if len(sampled) < n:
            tokens = x.argmax(dim=1)  # the greedy rows' answer; sampled rows are overwritten below
        else:
            tokens = torch.empty(n, dtype=torch.long, device=device)
        if sampled:
            rows = torch.tensor(sampled, device=device)
            if len(sampled) == n and x.data_ptr() != logits.data_ptr():
                sub = x  # our own tensor and logp already holds what we report: filter it in place
            else:
                sub = x.index_select(0, rows)
            _filter(sub, [params[i] for i in sampled])
            tokens[rows] = _draw(sub, [_draw_key(seeds[i], len(output_ids[i])) for i in sampled])

        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return SamplerOutput(
            token_ids=tokens.tolist(),
            logprobs=chosen.tolist(),
            top_tokens=_top_tokens(logp, params),
        )


def token_scores(
    logits: torch.Tensor, next_ids: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row i, in float32, a chunk of rows at a time: ``log_softmax(logits)[i, next_ids[i]]``, its rank (how many
    tokens score at least as high: 1 for the likeliest, as vLLM counts), and the `top_n` likeliest (logprobs [N, k],
    ids [N, k], best first)."""
    next_ids = next_ids.to(device=logits.device, dtype=torch.long)
    rows = logits.shape[0]
    chosen = torch.empty(rows, dtype=torch.float32, device=logits.device)
    ranks = torch.empty(rows, dtype=torch.long, device=logits.device)
    top_values = torch.empty(rows, top_n, dtype=torch.float32, device=logits.device)
    top_ids = torch.empty(rows, top_n, dtype=torch.long, device=logits.device)
    for start in range(0, rows, _LOGPROB_CHUNK):
        end = start + _LOGPROB_CHUNK
        lp = torch.log_softmax(logits[start:end].float(), dim=1)
        mine = lp.gather(1, next_ids[start:end].unsqueeze(1))
        chosen[start:end] = mine.squeeze(1)
        ranks[start:end] = (lp >= mine).sum(dim=1)
        if top_n:
            top_values[start:end], top_ids[start:end] = lp.topk(top_n, dim=1)
    return chosen, ranks, top_values, top_ids


# ---------------------------------------------------------------------------------------------- penalties


def _apply_penalties(
    x: torch.Tensor,
    original: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Repetition (HF), then frequency and presence (OpenAI) penalties; touches only the penalised entries."""
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    fp_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not rep_rows and not fp_rows:
        return x
    if x.data_ptr() == original.data_ptr():
        x = x.clone(memory_format=torch.contiguous_format)  # never edit the caller's logits
    x = x.contiguous()  # flat indexing below
    vocab = x.shape[1]
    flat = x.view(-1)

    if rep_rows:
        seqs = [chain(prompt_ids[i], output_ids[i]) for i in rep_rows]
        lengths = [len(prompt_ids[i]) + len(output_ids[i]) for i in rep_rows]
        idx, row_of = _flat_indices(seqs, lengths, rep_rows, vocab, x.device)
        if idx.numel():
            penalty = torch.tensor([params[i].repetition_penalty for i in range(len(params))], device=x.device)
            pen = penalty[row_of]
            vals = flat[idx]
            # Duplicate ids write identical values, so the unordered scatter is still deterministic.
            flat[idx] = torch.where(vals < 0, vals * pen, vals / pen)

    if fp_rows:
        lengths = [len(output_ids[i]) for i in fp_rows]
        idx, _ = _flat_indices([output_ids[i] for i in fp_rows], lengths, fp_rows, vocab, x.device)
        if idx.numel():
            uniq, counts = torch.unique(idx, return_counts=True)
            row_of = uniq // vocab
            freq = torch.tensor([p.frequency_penalty for p in params], device=x.device)[row_of]
            pres = torch.tensor([p.presence_penalty for p in params], device=x.device)[row_of]
            flat[uniq] -= counts.to(torch.float32) * freq + pres
    return x


def _flat_indices(
    seqs: Sequence[Sequence[int] | chain[int]],
    lengths: list[int],
    rows: list[int],
    vocab: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices ``row * vocab + id`` into a [N, V] tensor (ids outside the vocabulary dropped) and each one's row."""
    ids = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), torch.tensor(lengths, dtype=torch.long))
    # Like HF: ids the lm_head cannot produce (embedding vocab larger than the output vocab) get no penalty.
    keep = (ids >= 0) & (ids < vocab)
    if not bool(keep.all()):
        ids, row_of = ids[keep], row_of[keep]
    return (row_of * vocab + ids).to(device), row_of.to(device)


# ---------------------------------------------------------------------------------------------- filters


def _filter(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Apply top_k, top_p, min_p and typical_p in place (removed tokens become -inf). Each keeps >= 1 token."""
    device = x.device

    if any(p.top_k > 0 for p in params):
        sub, rows = _select(x, [p.top_k > 0 for p in params])
        ks = [min(p.top_k, x.shape[1]) for p in params if p.top_k > 0]
        kth = torch.topk(sub, max(ks), dim=1).values.gather(1, torch.tensor(ks, device=device).unsqueeze(1) - 1)
        _commit(x, rows, sub.masked_fill_(sub < kth, _NEG_INF))  # HF: ties with the k-th survive

    if any(p.top_p < 1.0 for p in params):
        sub, rows = _select(x, [p.top_p < 1.0 for p in params])
        mass = torch.tensor([p.top_p for p in params if p.top_p < 1.0], device=device)
        logp = torch.log_softmax(sub, dim=1)
        # HF TopPLogitsWarper: keep the most likely tokens until their mass reaches top_p (plus ties of the last).
        _commit(x, rows, sub.masked_fill_(logp < _mass_cutoff(logp, logp, mass, largest=True), _NEG_INF))

    if any(p.min_p > 0.0 for p in params):
        sub, rows = _select(x, [p.min_p > 0.0 for p in params])
        min_p = torch.tensor([p.min_p for p in params if p.min_p > 0.0], device=device).unsqueeze(1)
        probs = torch.softmax(sub, dim=1)
        # HF MinPLogitsWarper; the most likely token always passes, so at least one survives.
        _commit(x, rows, sub.masked_fill_(probs < min_p * probs.amax(dim=1, keepdim=True), _NEG_INF))

    if any(p.typical_p < 1.0 for p in params):
        sub, rows = _select(x, [p.typical_p < 1.0 for p in params])
        mass = torch.tensor([p.typical_p for p in params if p.typical_p < 1.0], device=device)
        logp = torch.log_softmax(sub, dim=1)
        probs = logp.exp()
        # Entropy from the last cumsum entry: row sums (sum/nansum) are not batch-invariant on CPU, cumsum is.
        entropy = -torch.where(probs > 0, probs * logp, 0.0).cumsum(dim=1)[:, -1:]
        # HF TypicalLogitsWarper: keep the tokens whose surprise is closest to the entropy, up to `mass`.
        key = (logp.neg() - entropy).abs_()
        _commit(x, rows, sub.masked_fill_(key > _mass_cutoff(key, logp, mass, largest=False), _NEG_INF))


def _select(x: torch.Tensor, active: list[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The active rows of x: x itself when every row is active (edits land in place), else a copy plus its rows."""
    if all(active):
        return x, None
    rows = torch.tensor([i for i, a in enumerate(active) if a], device=x.device)
    return x.index_select(0, rows), rows


def _commit(x: torch.Tensor, rows: torch.Tensor | None, sub: torch.Tensor) -> None:
    if rows is not None:
        x.index_copy_(0, rows, sub)


def _mass_cutoff(key: torch.Tensor, logp: torch.Tensor, mass: torch.Tensor, largest: bool) -> torch.Tensor:
    """Per row, the last key to keep: walking the tokens in key order (largest first, or smallest first), the key
    of the first token at which the cumulative probability reaches ``mass`` (HF's top-p / typical-p rule).
    Returns [R, 1]; callers drop the tokens ordered after it (ties with it stay).

    Looks at each row's first ``_PREFIX_SIZES`` keys in that order (a topk) and sorts the whole row only when
    the cut-off lies beyond them; a prefix's cumsum is the same whichever length it is computed over.
    """
    n, vocab = key.shape
    cutoff = torch.empty(n, 1, dtype=key.dtype, device=key.device)
    todo: torch.Tensor | None = None  # rows still unresolved; None: all of them
    for size in (*(s for s in _PREFIX_SIZES if s < vocab), vocab):
        k, lp, m = (key, logp, mass) if todo is None else (key[todo], logp[todo], mass[todo])
        if size < vocab:
            sorted_key, order = torch.topk(k, size, dim=1, largest=largest, sorted=True)
        else:
            sorted_key, order = torch.sort(k, dim=1, descending=largest)
        cum = lp.gather(1, order).exp_().cumsum(dim=1)
        last = (cum < m.unsqueeze(1)).sum(dim=1)  # an integer count: exact, hence batch-invariant
        found = sorted_key.gather(1, last.clamp(max=size - 1).unsqueeze(1))
        if size == vocab:  # not reached (rounding): clamped to the last token, so nothing more is removed
            done = torch.ones_like(last, dtype=torch.bool)
        else:
            done = last < size
        idx = torch.arange(n, device=key.device) if todo is None else todo
        cutoff[idx[done]] = found[done]
        todo = idx[~done]
        if todo.numel() == 0:
            break
    return cutoff


# ---------------------------------------------------------------------------------------------- draw


def _draw(x: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """One token per row of the filtered logits x, row i raced with noise seeded by keys[i].

    Level 1 races the blocks of ``_RACE_BLOCK`` tokens by their mass, level 2 the tokens of the winning block:
    P(token) = mass(block) / total * p(token) / mass(block), exactly the row's distribution. Removed tokens
    weigh 0 and cannot win.
    """
    n, vocab = x.shape
    blocks = -(-vocab // _RACE_BLOCK)
    noise = _race_noise(keys, blocks + _RACE_BLOCK).to(x.device)
    weight = (x - x.amax(dim=1, keepdim=True)).exp_()  # p up to a per-row factor, which the race ignores
    if blocks * _RACE_BLOCK != vocab:
        weight = torch.nn.functional.pad(weight, (0, blocks * _RACE_BLOCK - vocab))
    weight = weight.view(n, blocks, _RACE_BLOCK)
    mass = weight.cumsum(dim=2)[:, :, -1]  # cumsum, not sum: its per-row result does not depend on the batch
    block = (mass / noise[:, :blocks]).argmax(dim=1)
    inner = weight[torch.arange(n, device=x.device), block]
    return block * _RACE_BLOCK + (inner / noise[:, blocks:]).argmax(dim=1)


def _race_noise(keys: list[int], size: int) -> torch.Tensor:
    """[len(keys), size] Exp(1) noise (never 0), row i from a CPU generator seeded with keys[i]."""
    out = torch.empty(len(keys), size)
    gen = torch.Generator()
    for row, key in zip(out, keys):
        gen.manual_seed(key & 0xFFFFFFFF)  # the CPU generator only uses 32 bits of its seed
        row.uniform_(generator=gen)
    # -log(U), U in [0, 1): U < 1 keeps E > 0 (a 0 would make a removed token's 0 / 0 a NaN, which argmax picks).
    return out.log_().neg_()


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _draw_key(seed: int, step: int) -> int:
    """A well-mixed 64-bit key from (seed, step), so that nearby seeds and steps give unrelated draws."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


# ---------------------------------------------------------------------------------------------- reporting


def _top_tokens(logp: torch.Tensor, params: Sequence[SamplingParams]) -> list[list[tuple[int, float]]]:
    wanted = [min(p.top_n_tokens, logp.shape[1]) for p in params]
    out: list[list[tuple[int, float]]] = [[] for _ in params]
    rows = [i for i, k in enumerate(wanted) if k > 0]
    if not rows:
        return out
    vals, ids = torch.topk(logp[torch.tensor(rows, device=logp.device)], max(wanted), dim=1)
    for r, i, v in zip(rows, ids.tolist(), vals.tolist()):
        out[r] = list(zip(i[: wanted[r]], v[: wanted[r]]))
    return out
