"""A request's own restrictions of its next token (engine/sampling/constraints.py: logit bias, allowed token ids, bad
words, min tokens) give transformers' greedy tokens under its own logits processors on the same weights, in one batch
with plain requests and each other (a request's bias or mask never reaches another row)."""

from __future__ import annotations

import pytest
import torch

from loraplex.params import SamplingParams

NEW = 16


@pytest.fixture(scope="module")
def prompt(embedded) -> list[int]:
    tok = embedded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                      add_special_tokens=False)


def hf_greedy(embedded_hf, prompt: list[int], max_new: int = NEW, **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    out = embedded_hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                               pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def test_constrained_requests_in_one_batch_give_transformers_tokens(make_engine, embedded, embedded_hf, prompt):
    eos = embedded.tokenizer.eos_token_ids
    plain = hf_greedy(embedded_hf, prompt)
    first, second = plain[0], plain[1]
    ban_first = [[first]]
    # A two-token bad word: its second token is banned only right after its first.
    ban_pair = [[first, second]]
    allowed = sorted({*plain[2:], 11, 29, 1130, *eos})
    assert plain[-1] in eos and len(plain) + 3 < NEW, plain  # the plain answer ends early: min_tokens can hold it
    least = len(plain) + 3
    cases = {
        "plain": (SamplingParams(max_new_tokens=NEW), plain),
        "bias": (SamplingParams(max_new_tokens=NEW, logit_bias=((first, -100.0), (1130, 30.0))),
                 hf_greedy(embedded_hf, prompt, sequence_bias={(first,): -100.0, (1130,): 30.0})),
        "bad word": (SamplingParams(max_new_tokens=NEW, bad_words_ids=tuple(map(tuple, ban_first))),
                     hf_greedy(embedded_hf, prompt, bad_words_ids=ban_first)),
        "bad pair": (SamplingParams(max_new_tokens=NEW, bad_words_ids=tuple(map(tuple, ban_pair))),
                     hf_greedy(embedded_hf, prompt, bad_words_ids=ban_pair)),
        "allowed": (SamplingParams(max_new_tokens=NEW, allowed_token_ids=tuple(allowed)),
                    hf_greedy(embedded_hf, prompt, prefix_allowed_tokens_fn=lambda batch, ids: allowed)),
        "min tokens": (SamplingParams(max_new_tokens=NEW, min_tokens=least),
                       hf_greedy(embedded_hf, prompt, min_new_tokens=least)),
    }
    engine = make_engine()
    results = engine.generate([prompt] * len(cases), [params for params, _ in cases.values()])
    got = {name: r.token_ids for name, r in zip(cases, results)}
    for name, (_, want) in cases.items():
        assert got[name] == want, name
    # Each restriction changed this answer: the test could not pass by ignoring it.
    for name in ("bias", "bad word", "bad pair", "allowed", "min tokens"):
        assert got[name] != plain, name
    assert all(t not in eos for t in got["min tokens"][:least])


def test_min_tokens_holds_back_stop_strings_and_stop_ids_too(make_engine, embedded, prompt):
    engine = make_engine()
    plain = engine.generate([prompt], SamplingParams(max_new_tokens=NEW))[0]
    stop_id = plain.token_ids[0]
    stopped, held = engine.generate([prompt] * 2, [
        SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop_id,)),
        SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop_id,), min_tokens=4),
    ])
    assert len(stopped.token_ids) == 1
    assert len(held.token_ids) >= 4 and stop_id not in held.token_ids[:4]
    text = plain.generated_text.strip()[:2]
    by_string = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, stop=(text,), min_tokens=6))[0]
    assert len(by_string.token_ids) >= 6
