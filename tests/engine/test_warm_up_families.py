"""The start-up warm-up (engine/warm_up.py) on every model family: `loraplex serve` runs it on CUDA before taking
requests, so a family it cannot drive would keep the server from starting. Here on the CPU (forced on): it runs
to the end and leaves the engine clean, and the engine still answers."""

import pytest

from loraplex.params import SamplingParams
from tests.helpers import engine_for, load_ours, tiny_mpt, tiny_t5


def _llava(path):
    from tests.models.test_llava_next_parity import saved, tiny_llava

    return saved(tiny_llava(seed=0), path)


def _mllama(path):
    from tests.mllama_fixtures import tiny_pair

    return tiny_pair(path)[2:]


def _bart(path):
    from tests.models.test_bart_parity import tiny_bart

    return load_ours(tiny_bart(), path)


FAMILIES = {
    "mpt": lambda path: load_ours(tiny_mpt(), path),
    "t5": lambda path: load_ours(tiny_t5(gated=True), path),
    "bart": _bart,
    "llava-next": _llava,
    "mllama": _mllama,
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_warms_up_and_still_answers(family, tmp_path):
    model, config = FAMILIES[family](tmp_path)
    engine = engine_for(model, config, max_active_adapters=2, max_lora_rank=16, max_batch_prefill_tokens=32,
                        max_input_length=30, max_total_tokens=48, warm_up=True)
    assert engine.warms_up
    report = engine.warm_up()
    assert report.requests == 4  # two long prompts, then one short one over the zero adapter and one without
    assert not engine.has_unfinished and not engine.adapters.in_use and engine.lora.occupant == [None, None]
    assert engine.scheduler.allocator.num_used == 0
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
