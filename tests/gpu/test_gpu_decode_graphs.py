"""Decode steps replayed as CUDA graphs (engine/worker/decode_graphs.py) against eager steps: the same greedy tokens, for
a heterogeneous batch of 64 adapters of mixed ranks, sliding windows and ALiBi, and after adapters change slots
(CUDA only: `python -m pytest tests/gpu`)."""

import random

import pytest
import torch

from benchmarks.adapters import AdapterSpec, random_adapter
from loraplex.params import SamplingParams
from tests.gpu.test_gpu_parity import DEVICE, SMOLLM2_SHAPE
from tests.helpers import counting_launches, engine_for, load_ours, ours_from_hf, tiny_hf_model, tiny_mpt

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

NEW_TOKENS = 10


def prompts(count, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(count)]


def adapters_for(engine, count, seed=0):
    ranks = [4, 8, 16, 32]
    return [random_adapter(f"a{k}", engine.lora.base_shapes, AdapterSpec(rank=ranks[k % 4], alpha=2.0 * ranks[k % 4]),
                           64, seed=seed + k) for k in range(count)]


def tokens(engine, batch, adapters):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return [r.token_ids for r in engine.generate(batch, params, adapters=adapters)]


def llama(dtype, **overrides):
    hf = tiny_hf_model("llama", **(overrides or SMOLLM2_SHAPE)).to(DEVICE)
    return ours_from_hf(hf, device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_64_adapters_in_graphs_match_eager_and_solo(dtype):
    ours, config = llama(dtype)
    graphed = engine_for(ours, config, device=DEVICE, dtype=dtype, max_active_adapters=64, max_num_seqs=80)
    eager = engine_for(ours, config, device=DEVICE, dtype=dtype, max_active_adapters=64, max_num_seqs=80,
                       cuda_graphs=False)
    assert graphed.runner.decode_graphs is not None and eager.runner.decode_graphs is None
    adapters = adapters_for(graphed, 64)
    batch = prompts(72, config.vocab_size)
    used = adapters + [None] * 8
    with_graphs = tokens(graphed, batch, used)
    assert graphed.runner.decode_graphs.num_captured >= 1
    without = tokens(eager, batch, used)
    base = tokens(eager, batch, [None] * len(batch))
    changed = sum(a != b for a, b in zip(without[:64], base[:64]))
    assert changed >= 48, f"the adapters changed only {changed}/64 outputs: the test would not see LoRA break"
    if dtype == torch.float32:
        assert with_graphs == without
        solo = [tokens(eager, [p], [a])[0] for p, a in zip(batch[::9], used[::9])]
        assert solo == with_graphs[::9]
    else:  # bfloat16: graphs take fused kernels that round as the torch ops do but reduce in another order, so
        # over 30 layers a near tie may flip; the first tokens must agree, and most whole sequences
        first = sum(a[0] == b[0] for a, b in zip(with_graphs, without))
        same = sum(a == b for a, b in zip(with_graphs, without))
        assert first >= 0.95 * len(batch) and same >= 0.6 * len(batch), f"{first} first tokens, {same} sequences agree"


def test_new_adapters_in_old_slots_need_no_new_capture():
    ours, config = llama(torch.float32)
    graphed = engine_for(ours, config, device=DEVICE, dtype=torch.float32, max_active_adapters=4)
    eager = engine_for(ours, config, device=DEVICE, dtype=torch.float32, max_active_adapters=4, cuda_graphs=False)
    first, second = adapters_for(graphed, 4, seed=0), adapters_for(graphed, 4, seed=100)
    batch = prompts(4, config.vocab_size, seed=1)
    assert tokens(graphed, batch, first) == tokens(eager, batch, first)
    captured = graphed.runner.decode_graphs.num_captured
    assert tokens(graphed, batch, second) == tokens(eager, batch, second)  # same targets, other ranks and weights
    assert graphed.runner.decode_graphs.num_captured == captured


@pytest.mark.parametrize("model", ["mistral-window", "mpt-alibi"])
def test_graphs_match_eager_for_windows_and_alibi(model, tmp_path):
    if model == "mpt-alibi":
        ours, config = load_ours(tiny_mpt(), tmp_path)
        ours = ours.to(DEVICE)
    else:
        ours, config = ours_from_hf(tiny_hf_model("mistral", sliding_window=24).to(DEVICE), device=DEVICE)
    graphed = engine_for(ours, config, device=DEVICE, max_active_adapters=2)
    eager = engine_for(ours, config, device=DEVICE, max_active_adapters=2, cuda_graphs=False)
    adapters = adapters_for(graphed, 2)
    batch = prompts(6, config.vocab_size, seed=2)
    used = [adapters[0], None, adapters[1], None, adapters[0], adapters[1]]
    assert tokens(graphed, batch, used) == tokens(eager, batch, used)
    assert graphed.runner.decode_graphs.num_captured >= 1


def streamed(engine, batch, params):
    """Each request's (token id, logprob) as streamed, step by step."""
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(batch, params)]
    got = {i: [] for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id].append((out.token.id, out.token.logprob))
    return [got[i] for i in ids]


def test_plain_greedy_steps_take_the_graphs_own_picks_with_the_samplers_tokens_and_logprobs(monkeypatch):
    """Steps where every request is plain greedy read the argmax and its logprob computed in the graph; a step
    with a penalised request goes through the sampler. Both give what eager steps give."""
    ours, config = llama(torch.float32)
    graphed = engine_for(ours, config, device=DEVICE, dtype=torch.float32)
    eager = engine_for(ours, config, device=DEVICE, dtype=torch.float32, cuda_graphs=False)
    sampled_steps = []
    sample = graphed.runner.logits.sample
    monkeypatch.setattr(graphed.runner.logits, "sample", lambda *a, **k: sampled_steps.append(1) or sample(*a, **k))
    batch = prompts(6, config.vocab_size, seed=3)
    plain = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    penalised = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.3)
    for params, through_sampler in (([plain] * 6, False), ([plain] * 5 + [penalised], True)):
        sampled_steps.clear()
        got, expected = streamed(graphed, batch, params), streamed(eager, batch, params)
        assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in expected]
        torch.testing.assert_close([[lp for _, lp in r] for r in got], [[lp for _, lp in r] for r in expected],
                                   atol=1e-4, rtol=0)
        # Prefill steps always sample; decode steps only when some request is not plain greedy.
        assert (len(sampled_steps) > 2) == through_sampler, sampled_steps
    graphs = graphed.runner.decode_graphs
    assert graphs.captured(len(batch), with_adapters=False) is not None


def test_overlapped_graph_steps_give_the_tokens_of_steps_one_at_a_time():
    """Launched steps take their input tokens from the last replay's picks on the device (engine/worker/overlap.py):
    greedy tokens equal eager steps' and graphs read one at a time, for requests ending by length and by a stop
    token at different steps, over adapters of mixed ranks."""
    ours, config = llama(torch.float32)
    kw = dict(device=DEVICE, dtype=torch.float32, max_active_adapters=8)
    overlapped = engine_for(ours, config, **kw)
    one_at_a_time = engine_for(ours, config, overlap_steps=False, **kw)
    eager = engine_for(ours, config, cuda_graphs=False, **kw)
    assert overlapped._overlap and not one_at_a_time._overlap and not eager._overlap
    adapters = adapters_for(overlapped, 8)
    batch = prompts(24, config.vocab_size, seed=4)
    used = [adapters[i % 8] if i % 3 else None for i in range(24)]
    lengths = [SamplingParams(max_new_tokens=1 + i % 16, ignore_eos=True) for i in range(24)]
    first = [r.token_ids for r in eager.generate(batch, lengths, adapters=used)]
    # Every third request stops at its fourth token (when it has one) instead.
    params = [SamplingParams(max_new_tokens=16, stop_token_ids=(t[3],)) if i % 3 == 0 and len(t) > 4 else sp
              for i, (t, sp) in enumerate(zip(first, lengths))]
    expected = [(r.token_ids, r.finish_reason) for r in eager.generate(batch, params, adapters=used)]
    assert sum(reason == "eos_token" for _, reason in expected) >= 4
    counts = counting_launches(overlapped)
    for engine in (overlapped, one_at_a_time):
        assert [(r.token_ids, r.finish_reason) for r in engine.generate(batch, params, adapters=used)] == expected
        assert not engine.has_unfinished and engine.scheduler.allocator.num_used == 0
    assert counts["chained"] >= 10, counts


def test_a_row_turning_non_finite_in_a_launched_step_fails_alone():
    """An adapter poisoned in its slot mid-flight: the launched steps' non-finite rows fail their request when
    read; the others keep their tokens."""
    from tests.gpu.test_gpu_isolation import poisoned

    ours, config = llama(torch.float32)
    kw = dict(device=DEVICE, dtype=torch.float32, max_active_adapters=4)
    engine, reference = engine_for(ours, config, **kw), engine_for(ours, config, overlap_steps=False, **kw)
    adapters = adapters_for(engine, 3)
    batch = prompts(6, config.vocab_size, seed=5)
    used = [adapters[0], None, adapters[1], adapters[2], None, adapters[0]]  # adapters[2]: the victim's alone
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [r.token_ids for r in reference.generate(batch, params, adapters=used)]
    counts = counting_launches(engine)
    requests = [engine.add_request(p, params, adapter=a) for p, a in zip(batch, used)]
    finals = {}
    for step in range(100):
        if step == 3:
            engine.lora.install(requests[3].adapter_slot, poisoned(adapters[2], adapters[2].key, "b", float("nan")))
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        if not engine.has_unfinished:
            break
    assert counts["chained"] >= 3
    assert "non-finite" in (finals[requests[3].request_id].error or "")
    assert [finals[r.request_id].token_ids for i, r in enumerate(requests) if i != 3] == expected[:3] + expected[4:]
    assert engine.scheduler.allocator.num_used == 0


def test_waiting_requests_join_together_where_decode_steps_are_graphs():
    """Requests arriving one by one while others decode: with graphs, they join a few at a time (engine/scheduling/joins.py),
    so fewer steps run eagerly; the tokens are the same as when each joins at once."""
    ours, config = llama(torch.float32)
    kw = dict(device=DEVICE, dtype=torch.float32, max_active_adapters=8)
    assert engine_for(ours, config, **kw).scheduler.joins.max_waiting_steps == 20  # LoRAX's default
    assert engine_for(ours, config, cuda_graphs=False, **kw).scheduler.joins.max_waiting_steps == 0
    batch = prompts(16, config.vocab_size, seed=5)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    results = []
    for waiting in (6, 0):
        engine = engine_for(ours, config, max_waiting_tokens=waiting, **kw)
        ids = [engine.add_request(p, params).request_id for p in batch[:4]]
        tokens, eager_steps, steps = {}, 0, 0
        while engine.has_unfinished or len(ids) < len(batch):
            if steps % 2 == 0 and len(ids) < len(batch):  # one arrival every other step
                ids.append(engine.add_request(batch[len(ids)], params).request_id)
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.token_ids
            eager_steps += not engine.step_in_flight
            steps += 1
        results.append(([tokens[i] for i in ids], eager_steps))
    (grouped, grouped_eager), (at_once, at_once_eager) = results
    assert grouped == at_once and all(len(t) == 24 for t in grouped)
    assert grouped_eager < at_once_eager, (grouped_eager, at_once_eager)


def test_a_warmed_up_engine_has_every_graph_and_a_cold_engines_tokens():
    """engine/warm_up.py: every batch size's graphs are captured before the first request, over an adapter on
    PEFT's all-linear modules and without; requests after it (over such an adapter) capture none and get the tokens
    of an engine that never warmed up."""
    ours, config = llama(torch.float32)
    kw = dict(device=DEVICE, dtype=torch.float32, max_active_adapters=4, max_num_seqs=32)
    warm, cold = engine_for(ours, config, **kw), engine_for(ours, config, **kw)
    report = warm.warm_up()
    graphs = warm.runner.decode_graphs
    assert report.graphs_captured == graphs.num_captured == 2 * len(graphs.sizes)
    assert warm.lora.occupant == [None] * 4 and warm.scheduler.allocator.num_used == 0
    all_linear = random_adapter("all-linear", warm.lora.base_shapes, AdapterSpec(rank=8, alpha=16.0), 64, seed=3)
    assert "lm_head" not in {name.rsplit(".", 1)[-1] for name in all_linear.modules}  # the seven projections
    batch = prompts(6, config.vocab_size, seed=2)
    used = [all_linear, None] * 3
    assert tokens(warm, batch, used) == tokens(cold, batch, used)
    assert graphs.num_captured == 2 * len(graphs.sizes)  # nothing new to capture


def test_after_the_warm_up_a_step_mixing_adapters_compiles_no_kernel(monkeypatch):
    """engine/warm_up.py: the tile kernels a step of several adapters' rows takes are compiled in the warm-up, not in
    the first such step (which stalled every request in it: a cold wave of 16 adapters waited ~1 s on the H100)."""
    from loraplex.lora.step.kernels import sgmv

    for launcher in (sgmv._shrink, sgmv._expand):  # what earlier tests launched is forgotten: counted from here
        monkeypatch.setattr(launcher, "_compiled", {})
    ours, config = llama(torch.float32)
    warm = engine_for(ours, config, device=DEVICE, dtype=torch.float32, max_active_adapters=4, max_num_seqs=32)
    warm.warm_up()
    compiled = len(sgmv._shrink._compiled) + len(sgmv._expand._compiled)
    assert compiled >= 2  # the warm-up launched both
    first, second = (random_adapter(f"mixed-{k}", warm.lora.base_shapes, AdapterSpec(rank=8, alpha=16.0), 64, seed=k)
                     for k in (4, 5))
    assert len(tokens(warm, prompts(4, config.vocab_size, seed=3), [first, second] * 2)[0]) > 0
    assert len(sgmv._shrink._compiled) + len(sgmv._expand._compiled) == compiled
