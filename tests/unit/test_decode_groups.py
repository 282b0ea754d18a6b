"""The runner's grouping of decode sequences by length."""

from loraplex.engine.worker.batch import group_by_length


def test_decode_groups_keep_lengths_close():
    lens = [300, 20, 25, 90, 310, 200, 30]
    groups = group_by_length(list(range(len(lens))), lens)
    assert sorted(s for g in groups for s in g) == list(range(len(lens)))
    for g in groups:
        shortest, longest = min(lens[s] for s in g), max(lens[s] for s in g)
        assert longest <= 1.5 * shortest or longest - shortest <= 64
    assert len(group_by_length([0, 1, 2], [128, 128, 128])) == 1


def test_a_backend_reading_the_cache_in_place_takes_every_decode_row_in_one_group(make_engine):
    """The Triton backend's setting (pads_decode_groups False) on the torch reference: one group per step,
    whatever the lengths, and the same greedy tokens as the grouped steps."""
    from loraplex.params import SamplingParams

    def run(one_group: bool) -> tuple[list[list[int]], list[int]]:
        engine = make_engine()
        if one_group:
            engine.runner.backend.pads_decode_groups = False
        groups_per_step = []
        build = engine.runner.batches.build

        def counting_build(*args, **kwargs):
            batch = build(*args, **kwargs)
            groups_per_step.append(len(batch.metadata.decode_groups))
            return batch

        engine.runner.batches.build = counting_build
        params = SamplingParams(max_new_tokens=6, ignore_eos=True)
        requests = [engine.add_request(list(range(5, 5 + n)), params) for n in (3, 90)]
        engine.step()
        engine.step()  # both decode; then a third prompt joins two decoding rows 90 tokens apart
        requests.append(engine.add_request(list(range(7, 40)), params))
        while engine.has_unfinished:
            engine.step()
        return [r.output_ids for r in requests], groups_per_step

    grouped, grouped_counts = run(one_group=False)
    together, together_counts = run(one_group=True)
    assert together == grouped
    assert max(grouped_counts) == 2  # the lengths 3 and 90 are apart: the reference pads them separately
    assert max(together_counts) == 1
