"""Stopping and reporting on the embedded model: stop strings, EOS, stop ids, logprobs."""

import math

import torch

from loraplex.params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper."


def chat_ids(tokenizer, text=PROMPT):
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def test_stop_string_across_token_boundary_is_cut(make_engine):
    engine = make_engine()
    ids = chat_ids(engine.tokenizer)
    (free,) = engine.generate([ids], SamplingParams(max_new_tokens=40, ignore_eos=True))
    pieces = [engine.tokenizer.decode(free.token_ids[: i + 1]) for i in range(len(free.token_ids))]
    # A stop string made of the end of one token and the start of the next.
    boundary = next(i for i in range(5, len(pieces) - 1) if len(pieces[i]) - len(pieces[i - 1]) >= 2
                    and len(pieces[i + 1]) - len(pieces[i]) >= 2)
    end_of_token = pieces[boundary][-2:]
    start_of_next = pieces[boundary + 1][len(pieces[boundary]) : len(pieces[boundary]) + 2]
    stop = end_of_token + start_of_next
    (stopped,) = engine.generate([ids], SamplingParams(max_new_tokens=40, ignore_eos=True, stop=("zzzq", stop)))
    assert stopped.finish_reason.value == "stop_sequence"
    assert stopped.generated_text == free.generated_text[: free.generated_text.index(stop)]
    assert stopped.num_generated_tokens <= boundary + 2


def test_eos_stops_unless_ignored(make_engine):
    engine = make_engine()
    ids = chat_ids(engine.tokenizer, "Say hello.")
    (natural,) = engine.generate([ids], SamplingParams(max_new_tokens=64))
    assert natural.finish_reason.value == "eos_token" and natural.token_ids[-1] in engine.tokenizer.eos_token_ids
    assert "<|im_end|>" not in natural.generated_text
    (ignored,) = engine.generate([ids], SamplingParams(max_new_tokens=64, ignore_eos=True))
    assert ignored.finish_reason.value == "length" and ignored.num_generated_tokens == 64


def test_extra_stop_token_id(make_engine):
    engine = make_engine()
    ids = chat_ids(engine.tokenizer)
    (free,) = engine.generate([ids], SamplingParams(max_new_tokens=20, ignore_eos=True))
    stop_id = free.token_ids[5]
    (stopped,) = engine.generate([ids], SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=(stop_id,)))
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert stopped.finish_reason.value == "eos_token"


def test_logprobs_alternatives_and_prompt_logprobs_match_transformers(make_engine, embedded_hf):
    engine = make_engine(max_batch_prefill_tokens=5)  # prompt logprobs gathered across prefill chunks
    ids = engine.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    params = SamplingParams(max_new_tokens=4, top_n_tokens=3, prompt_logprobs=True, ignore_eos=True)
    outputs = []
    request = engine.add_request(ids, params)
    while engine.has_unfinished:
        outputs += engine.step()
    final = outputs[-1]
    full = torch.tensor([ids + final.token_ids])
    logprobs = torch.log_softmax(embedded_hf(full).logits[0].float(), -1)
    # Prompt: the first token has none, token i is predicted at position i - 1.
    assert final.prompt_tokens[0].logprob is None and len(final.prompt_tokens) == len(ids)
    for i in range(1, len(ids)):
        assert math.isclose(final.prompt_tokens[i].logprob, logprobs[i - 1, ids[i]].item(), abs_tol=1e-3)
    for step, out in enumerate(outputs):
        pos = len(ids) - 1 + step
        assert math.isclose(out.token.logprob, logprobs[pos, out.token.id].item(), abs_tol=1e-3)
        top = torch.topk(logprobs[pos], 3)
        assert [t.id for t in out.token.top_tokens] == top.indices.tolist()
    assert request.finished
