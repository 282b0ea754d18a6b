"""What the quantized-model GPU tests share (test_gpu_quantization, test_gpu_w4a16, test_gpu_fp8): a small Llama
(4 layers, hidden 512, GQA), its prompt, the sampling, and bfloat16's tolerance. No CUDA needed to import."""

import dataclasses

import torch

from loraplex.params import SamplingParams

DEVICE, DTYPE = "cuda", torch.bfloat16
SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2)
PROMPT = [1, 17, 203, 45, 9, 88, 130, 7, 251, 64, 3, 99, 180, 42, 5, 77, 211, 8, 150, 33, 120, 2048, 4000, 3071]
NEW = 12
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


def tolerance(expected: torch.Tensor) -> float:
    return 6e-2 * max(1.0, expected.abs().max().item())  # bfloat16, as tests/gpu/test_gpu_parity.py


def streams(engine, prompts: list[list[int]], params: SamplingParams, adapters: list) -> list[list]:
    """Each request's generated TokenInfos (with their top alternatives: params.top_n_tokens), run together."""
    requests = [engine.add_request(p, params, adapter=a) for p, a in zip(prompts, adapters)]
    tokens = {r.request_id: [] for r in requests}
    while engine.has_unfinished:
        for out in engine.step():
            if out.token is not None:
                tokens[out.request_id].append(out.token)
    return [tokens[r.request_id] for r in requests]


def assert_batch_matches_solo(engine, prompts: list[list[int]], params: SamplingParams, adapters: list,
                              near_tie: float) -> int:
    """Greedy tokens of the requests run together equal each one's run alone, up to the first place they part,
    which must be a near tie: there the batch's log-probability of the lone run's token is within `near_tie` of its
    own pick (kernels for other row counts sum in other orders). Returns how many tokens were compared equal."""
    top = max(params.top_n_tokens, 5)
    params = dataclasses.replace(params, top_n_tokens=top)
    together = streams(engine, prompts, params, adapters)
    solo = [streams(engine, [p], params, [a])[0] for p, a in zip(prompts, adapters)]
    equal = 0
    for index, (batch, alone) in enumerate(zip(together, solo)):
        for step, (got, want) in enumerate(zip(batch, alone)):
            if got.id == want.id:
                equal += 1
                continue
            alternatives = {t.id: t.logprob for t in got.top_tokens}
            assert want.id in alternatives and got.logprob - alternatives[want.id] <= near_tie, (
                f"request {index} step {step}: batch picked {got.id} ({got.logprob:.4f}), alone {want.id} "
                f"({alternatives.get(want.id)} in the batch's top {top}): not a near tie")
            break
    return equal
