"""Which q/k pairs the fused rotary kernel may rotate in one launch (layers/rotary.py): q's and k's heads side by
side in one product's output, whatever the number of rows."""

import torch

from loraplex.layers.rotary import _adjacent_heads


def q_and_k(rows, heads=4, kv_heads=2, dim=8):
    qkv = torch.zeros(rows, (heads + 2 * kv_heads) * dim)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(rows, heads, dim), k.view(rows, kv_heads, dim), v.view(rows, kv_heads, dim)


def test_q_and_k_of_one_fused_product_are_adjacent_for_one_row_and_many():
    for rows in (1, 2, 7):
        q, k, v = q_and_k(rows)
        assert _adjacent_heads(q, k), rows
        assert not _adjacent_heads(k, q) and not _adjacent_heads(q, v)
    q, k, _ = q_and_k(1)
    assert q.stride(0) != k.stride(0)  # a single row's view strides differ: they must not decide


def test_separate_tensors_and_other_layouts_are_not_adjacent():
    q, k = torch.zeros(3, 4, 8), torch.zeros(3, 2, 8)
    assert not _adjacent_heads(q, k)
    q, k, _ = q_and_k(3, dim=8)
    assert not _adjacent_heads(q.transpose(1, 2), k.transpose(1, 2))
    assert not _adjacent_heads(q[:2], k[1:])
