"""The fused elementwise kernels (layers/kernels/elementwise.py) against their torch references (CUDA only:
`python -m pytest tests/gpu`)."""

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

from loraplex.layers.kernels.elementwise import add_rms_norm, rms_norm, rotary, silu_and_mul  # noqa: E402
from loraplex.layers.norms import RMSNorm  # noqa: E402
from loraplex.layers import rotary as rotary_module  # noqa: E402

DEVICE = "cuda"
# float32: reductions may sum in another order; bfloat16: at most one rounding step apart.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


def reference_rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 4096), (37, 576), (5, 9, 64)])
def test_rms_norm(dtype, shape, monkeypatch):
    x = torch.randn(shape, device=DEVICE).to(dtype) * 3
    weight = torch.randn(shape[-1], device=DEVICE).to(dtype)
    got, expected = rms_norm(x, weight, 1e-5), reference_rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    norm = RMSNorm(shape[-1], 1e-5).to(DEVICE, dtype)
    norm.weight.data.copy_(weight)
    torch.testing.assert_close(norm(x), got, atol=0, rtol=0)  # eager, launched directly: the kernel
    with monkeypatch.context() as through_triton:
        through_triton.setenv("LORAPLEX_DIRECT_LAUNCH", "0")
        torch.testing.assert_close(norm(x), expected, atol=0, rtol=0)  # eager through Triton's path: the torch ops
    norm(x)  # warm-up before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = norm(x)
    graph.replay()
    torch.testing.assert_close(captured, got, atol=0, rtol=0)  # captured: the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 4096), (37, 576)])
def test_add_rms_norm(dtype, shape):
    x, residual = (torch.randn(shape, device=DEVICE).to(dtype) * 3 for _ in range(2))
    weight = torch.randn(shape[-1], device=DEVICE).to(dtype)
    normed, summed = add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, residual + x, atol=0, rtol=0)  # rounded as the torch sum rounds
    torch.testing.assert_close(normed, reference_rms_norm(residual + x, weight, 1e-5), **TOLERANCE[dtype])
    norm = RMSNorm(shape[-1], 1e-5).to(DEVICE, dtype)
    norm.weight.data.copy_(weight)
    eager = norm.add_and_norm(x, residual)  # launched directly: the kernel
    torch.testing.assert_close(eager[0], normed, atol=0, rtol=0)
    torch.testing.assert_close(eager[1], summed, atol=0, rtol=0)
    norm.add_and_norm(x, residual)  # warm-up before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = norm.add_and_norm(x, residual)
    graph.replay()
    torch.testing.assert_close(captured[0], normed, atol=0, rtol=0)  # captured: the kernel
    torch.testing.assert_close(captured[1], summed, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 14336), (64, 1536), (3, 7)])
def test_silu_and_mul(dtype, shape):
    gate, up = (torch.randn(shape, device=DEVICE).to(dtype) * 4 for _ in range(2))
    torch.testing.assert_close(silu_and_mul(gate, up), F.silu(gate) * up, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_and_mul_on_the_halves_of_a_fused_gate_up_product(dtype):
    gate, up = (torch.randn(5, 2 * 1536, device=DEVICE).to(dtype) * 4).split(1536, dim=1)  # strided rows
    assert not gate.is_contiguous()
    torch.testing.assert_close(silu_and_mul(gate, up), F.silu(gate) * up, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,dim", [(32, 128), (3, 64), (2, 96)])
def test_rotary(dtype, heads, dim):
    from loraplex.layers.rotary import RopeConfig

    rows = 19
    embedding = rotary_module.RotaryEmbedding(RopeConfig(theta=10000.0), dim)
    cos, sin = embedding(torch.arange(1000, 1000 + rows, device=DEVICE), dtype)
    x = torch.randn(rows, heads * dim, device=DEVICE).to(dtype).view(rows, heads, dim)
    expected = x * cos + rotary_module._rotate_half(x) * sin
    torch.testing.assert_close(rotary(x, cos, sin), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 7])  # one row: its view strides of q and k differ, and must not matter
def test_rotary_of_q_and_k_side_by_side_in_a_fused_product_is_one_launch_with_the_same_values(dtype, rows, monkeypatch):
    from loraplex.layers.rotary import RopeConfig

    heads, kv_heads, dim = 8, 2, 64
    embedding = rotary_module.RotaryEmbedding(RopeConfig(theta=10000.0), dim)
    cos, sin = embedding(torch.arange(300, 300 + rows, device=DEVICE), dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device=DEVICE).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(rows, heads, dim), k.view(rows, kv_heads, dim)
    assert rotary_module._adjacent_heads(q, k) and not rotary_module._adjacent_heads(k, q)
    launches = []
    monkeypatch.setattr(rotary_module, "fused_kernels_wanted", lambda device: True)
    import loraplex.layers.kernels.elementwise as elementwise

    real = elementwise.rotary
    monkeypatch.setattr(elementwise, "rotary", lambda x, c, s: launches.append(x.shape) or real(x, c, s))
    rotated_q, rotated_k = rotary_module.apply_rotary(q, k, (cos, sin))
    assert launches == [(rows, heads + kv_heads, dim)]
    torch.testing.assert_close(rotated_q, q * cos + rotary_module._rotate_half(q) * sin, **TOLERANCE[dtype])
    torch.testing.assert_close(rotated_k, k * cos + rotary_module._rotate_half(k) * sin, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_heads,dim", [(8, 128), (3, 80)])
def test_write_kv_equals_the_references_index_copies(dtype, kv_heads, dim):
    from loraplex.layers.attention import TorchAttentionBackend
    from loraplex.layers.kernels.kv_write import write_kv

    blocks, block_size, rows = 6, 16, 5
    caches = [torch.randn(blocks, block_size, kv_heads, dim, device=DEVICE).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    qkv = torch.randn(rows, 3 * kv_heads * dim, device=DEVICE).to(dtype)  # k and v strided views, as in a fused product
    k, v = (t.view(rows, kv_heads, dim) for t in qkv.split(kv_heads * dim, dim=-1)[1:])
    slots = torch.tensor([3, 17, 40, 95, 64], device=DEVICE)
    write_kv(*caches, slots, k, v)
    TorchAttentionBackend._write_kv(*expected, slots, k, v)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
