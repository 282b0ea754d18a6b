"""Which of a step's prefill sequences the variable-length prefill takes (fresh prompts: nothing cached before them),
and how their rows are addressed (the kernel itself runs on CUDA only: tests/gpu/test_gpu_varlen_prefill.py)."""

import torch

from loraplex.layers.prefill_runs import fresh_prompts
from loraplex.layers.forward_context import AttentionMetadata


def metadata(new_and_total: list[tuple[int, int]], prefill: list[int]) -> AttentionMetadata:
    starts = [0]
    for new, _ in new_and_total:
        starts.append(starts[-1] + new)
    return AttentionMetadata(slot_mapping=torch.zeros(starts[-1]), block_tables=torch.zeros(1, 1), decode_groups=[],
                             seq_lens=[total for _, total in new_and_total], query_start_loc=starts, prefill_seqs=prefill)


def test_contiguous_fresh_prompts_are_one_slice():
    md = metadata([(1, 9), (4, 4), (3, 3)], prefill=[1, 2])
    fresh = fresh_prompts(md, torch.device("cpu"))
    assert fresh.rows == slice(1, 8) and fresh.cu_seqlens.tolist() == [0, 4, 7] and fresh.max_len == 4
    assert fresh.cu_seqlens.dtype == torch.int32 and fresh.others == []
    assert fresh_prompts(md, torch.device("cpu")) is fresh  # once per step


def test_a_resumed_prompt_between_fresh_ones_leaves_an_index():
    md = metadata([(2, 2), (3, 10), (4, 4)], prefill=[0, 1, 2])
    fresh = fresh_prompts(md, torch.device("cpu"))
    assert fresh.rows.tolist() == [0, 1, 5, 6, 7, 8] and fresh.cu_seqlens.tolist() == [0, 2, 6]
    assert fresh.others == [1]


def test_no_fresh_prompt():
    assert fresh_prompts(metadata([(3, 10)], prefill=[0]), torch.device("cpu")) is None
