"""The Triton backend's prefill plumbing on the CPU (layers/attention.py): fresh prompts and prompts resumed over
cached context go to the variable-length kernel in one call each, with the right rows, offsets and keys gathered
from the paged cache. The kernel is CUDA-only, so a per-sequence stand-in with the kernel's contract (queries at
the end of their keys) takes its place here; on the GPU the kernel itself is checked against the reference
(tests/gpu/test_gpu_varlen_prefill.py)."""

import pytest
import torch
import torch.nn.functional as F

from loraplex.layers.attention import PagedAttention, TorchAttentionBackend, TritonAttentionBackend
from loraplex.layers.prefill_runs import resumed_prompts
from loraplex.layers.forward_context import AttentionMetadata
from loraplex.layers.kernels import varlen_prefill
from loraplex.layers.masks import visible_keys

BLOCK = 4
# (new rows, tokens after the step): fresh, resumed over 30 cached, fresh, resumed over 17, fresh of one row, fresh
SEQS = [(5, 5), (10, 40), (37, 37), (3, 20), (1, 1), (6, 6)]


def kernel_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
    """`causal_varlen`'s contract, one sequence at a time: sequence i's queries are the last of its keys."""
    assert max_q == max(int(b - a) for a, b in zip(cu_q, cu_q[1:]))
    assert max_k == max(int(b - a) for a, b in zip(cu_k, cu_k[1:]))
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        rows, keys = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        visible = visible_keys(rows.stop - rows.start, keys.stop - keys.start, window, q.device)
        attended = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], k[keys].transpose(0, 1)[None],
                                                  v[keys].transpose(0, 1)[None], attn_mask=visible, scale=scale,
                                                  enable_gqa=True)
        out[rows] = attended[0].transpose(0, 1)
    return out


def step(heads=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(new for new, _ in SEQS)
    q = torch.randn(rows, heads, dim, generator=g)
    k, v = torch.randn(rows, kv_heads, dim, generator=g), torch.randn(rows, kv_heads, dim, generator=g)
    widest = -(-max(total for _, total in SEQS) // BLOCK)
    num_blocks = len(SEQS) * widest + 3
    cache = [torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g) for _ in range(2)]
    tables = torch.randperm(num_blocks, generator=g)[: len(SEQS) * widest].view(len(SEQS), widest)
    starts, slots = [0], []
    for s, (new, total) in enumerate(SEQS):
        starts.append(starts[-1] + new)
        slots += [int(tables[s, p // BLOCK]) * BLOCK + p % BLOCK for p in range(total - new, total)]
    md = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=tables, decode_groups=[],
                           seq_lens=[total for _, total in SEQS], query_start_loc=starts, prefill_seqs=list(range(len(SEQS))))
    return q, k, v, cache, md


def test_resumed_keys_are_every_position_of_each_sequence_in_its_blocks():
    _, _, _, _, md = step()
    resumed = resumed_prompts(md, [1, 3], BLOCK, torch.device("cpu"))
    expected = [int(md.block_tables[s, p // BLOCK]) * BLOCK + p % BLOCK for s in (1, 3) for p in range(SEQS[s][1])]
    assert resumed.key_slots.tolist() == expected
    assert resumed.cu_seqlens_q.tolist() == [0, 10, 13] and resumed.cu_seqlens_k.tolist() == [0, 40, 60]
    assert resumed.rows.tolist() == list(range(5, 15)) + list(range(52, 55))
    assert (resumed.max_len_q, resumed.max_len_k) == (10, 40) and resumed.cu_seqlens_q.dtype == torch.int32


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("resumed_usable", [True, False])
def test_fresh_and_resumed_prompts_take_one_kernel_call_each_and_match_the_reference(monkeypatch, window,
                                                                                     resumed_usable):
    calls = []
    monkeypatch.setattr(varlen_prefill, "varlen_usable", lambda q, kv_heads: True)
    monkeypatch.setattr(varlen_prefill, "resumed_varlen_usable", lambda q, kv_heads: resumed_usable)
    monkeypatch.setattr(varlen_prefill, "causal_varlen", 
                        lambda *a: calls.append((a[3].tolist(), a[4].tolist())) or kernel_stand_in(*a))
    layer = PagedAttention(0, 4, 2, 8, 8**-0.5, sliding_window=window)
    q, k, v, cache, md = step()
    expected = TorchAttentionBackend().forward(layer, q, k, v, [c.clone() for c in cache], md)
    reference_calls = []
    prefill = TorchAttentionBackend._prefill
    monkeypatch.setattr(TorchAttentionBackend, "_prefill", lambda self, *a: reference_calls.append(a[-1]) or prefill(self, *a))
    _, _, _, _, md = step()  # a fresh step: nothing cached from the reference's run
    got = TritonAttentionBackend().forward(layer, q, k, v, [c.clone() for c in cache], md)
    torch.testing.assert_close(got, expected)
    fresh = ([0, 5, 42, 43, 49], [0, 5, 42, 43, 49])  # (query offsets, key offsets): their keys are their rows
    if resumed_usable:
        assert calls == [fresh, ([0, 10, 13], [0, 40, 60])] and reference_calls == []
    else:
        assert calls == [fresh] and reference_calls == [1, 3]


def kernel_aligned_to_the_start(q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
    """What a kernel whose causal mask starts each sequence's queries at its first key would give."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        rows, keys = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        attended = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], k[keys].transpose(0, 1)[None],
                                                  v[keys].transpose(0, 1)[None], is_causal=True, scale=scale,
                                                  enable_gqa=True)
        out[rows] = attended[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("kernel, usable", [(kernel_stand_in, True), (kernel_aligned_to_the_start, False)])
def test_the_probe_takes_resumed_prompts_only_to_a_kernel_aligned_to_the_end(monkeypatch, kernel, usable):
    monkeypatch.setattr(varlen_prefill, "causal_varlen", kernel)
    probe = varlen_prefill._aligned_to_the_end.__wrapped__  # uncached
    assert probe(torch.device("cpu"), torch.bfloat16, 64, 3) is usable
