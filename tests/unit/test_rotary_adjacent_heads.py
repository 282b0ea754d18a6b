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


def separate_but_touching(rows=3, heads=4, kv_heads=2, dim=8):
    """q and k as two allocations whose memory happens to touch (as a quantized layer's separate q and k outputs
    can): two numpy views of one buffer become two torch tensors with storages of their own."""
    import numpy as np

    buffer = np.zeros(rows * (heads + kv_heads) * dim, dtype=np.float32)
    q = torch.from_numpy(buffer[: rows * heads * dim]).view(rows, heads, dim)
    k = torch.from_numpy(buffer[rows * heads * dim :]).view(rows, kv_heads, dim)
    return q, k


def test_touching_allocations_are_not_one_tensor():
    q, k = separate_but_touching(rows=1)
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()  # the addresses alone would say adjacent
    assert not _adjacent_heads(q, k)


def test_a_view_reaching_past_its_storage_is_refused():
    qkv = torch.zeros(1, 6 * 8)
    q = qkv[:, : 4 * 8].view(1, 4, 8)
    k = qkv[:, 4 * 8 :].view(1, 2, 8)
    assert _adjacent_heads(q, k)
    assert not _adjacent_heads(q, qkv[:, 4 * 8 :].view(1, 2, 8)[:, :1].expand(1, 3, 8).contiguous())


def test_the_fused_path_rotates_touching_allocations_one_by_one(monkeypatch):
    """With the fused kernel forced (a torch stand-in that records what it is handed), q and k of separate
    allocations are rotated each on its own, never as one view over both; one tensor's q and k in one call."""
    import sys
    import types

    import loraplex.layers.rotary as rotary

    calls = []

    def stand_in(x, cos, sin):
        calls.append(tuple(x.shape))
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    monkeypatch.setattr(rotary, "fused_kernels_wanted", lambda device: True)
    # The kernels' module needs Triton: a stand-in module in its place.
    monkeypatch.setitem(sys.modules, "loraplex.layers.kernels.elementwise", types.SimpleNamespace(rotary=stand_in))
    for rows in (1, 3):  # one row: the case where the row strides cannot tell the allocations apart
        cos, sin = torch.rand(rows, 1, 8), torch.rand(rows, 1, 8)
        q, k = separate_but_touching(rows)
        q.copy_(torch.randn(q.shape)), k.copy_(torch.randn(k.shape))
        reference = (stand_in(q, cos, sin), stand_in(k, cos, sin))
        calls.clear()
        out_q, out_k = rotary.apply_rotary(q, k, (cos, sin))
        assert calls == [(rows, 4, 8), (rows, 2, 8)]
        assert torch.equal(out_q, reference[0]) and torch.equal(out_k, reference[1])
    fused_q, fused_k, _ = q_and_k(3)
    calls.clear()
    rotary.apply_rotary(fused_q, fused_k, (cos, sin))
    assert calls == [(3, 6, 8)]
