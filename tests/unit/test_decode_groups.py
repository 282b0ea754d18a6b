"""The runner's grouping of decode sequences by length."""

from loraplex.engine.runner import group_by_length


def test_decode_groups_keep_lengths_close():
    lens = [300, 20, 25, 90, 310, 200, 30]
    groups = group_by_length(list(range(len(lens))), lens)
    assert sorted(s for g in groups for s in g) == list(range(len(lens)))
    for g in groups:
        shortest, longest = min(lens[s] for s in g), max(lens[s] for s in g)
        assert longest <= 1.5 * shortest or longest - shortest <= 64
    assert len(group_by_length([0, 1, 2], [128, 128, 128])) == 1
