"""The online benchmark's graph warm-up (benchmarks/online.warm_decode_graphs): for every CUDA-graph batch size it
runs decode steps of exactly that many rows, over adapters and on the base model, so that a timed run captures
nothing. On the CPU there are no graphs: the steps it runs for given sizes are watched instead."""

import torch

from benchmarks.adapters import AdapterSpec, random_adapter
from benchmarks.gpu import build_model
from benchmarks.online import decode_at_sizes, warm_decode_graphs
from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine


SIZES = [1, 2, 4, 6]


def test_every_graph_size_decodes_with_adapters_and_without():
    loaded = build_model("135m", torch.device("cpu"), torch.float32, 2, smoke=True)
    engine = Engine(loaded, EngineConfig(device="cpu", max_input_length=16, max_total_tokens=32, max_active_adapters=2,
                                         max_lora_rank=8))
    adapters = [random_adapter(f"a{k}", engine.lora.base_shapes, AdapterSpec(rank=8), 8, seed=k) for k in range(3)]
    assert warm_decode_graphs(engine, adapters, loaded.config.vocab_size) == 0  # no graphs on the CPU: nothing
    decode_steps = set()
    schedule = engine.scheduler.schedule

    def watched():
        plan = schedule()
        if plan.scheduled and all(item.num_new_tokens == 1 and item.request.num_computed_tokens >= 4
                                  for item in plan.scheduled):
            on_adapters = {item.request.adapter_id is not None for item in plan.scheduled}
            assert len(on_adapters) == 1, "a warm-up step mixed adapter rows and base rows"
            decode_steps.add((len(plan.scheduled), on_adapters.pop()))
        return plan

    engine.scheduler.schedule = watched
    decode_at_sizes(engine, SIZES, adapters, loaded.config.vocab_size)
    assert decode_steps == {(rows, on) for rows in SIZES for on in (True, False)}
    assert not engine.has_unfinished
