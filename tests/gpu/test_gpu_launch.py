"""The direct launcher (kernels/launch.py) against Triton's own launch path (CUDA only: `python -m pytest
tests/gpu`): the same results, and for every specialisation Triton makes, the very kernel Triton picks."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402

from loraplex.kernels.launch import Launcher  # noqa: E402

DEVICE = "cuda"
BLOCK = 32


@triton.jit(do_not_specialize=["shift"])
def _affine_kernel(x_ptr, out_ptr, n, shift, scale, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if SQUARE:
        x = x * x
    tl.store(out_ptr + cols, (x * scale + (shift % 1000).to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)


class _CountingKernel:
    """The kernel, counting the launches that go through Triton's own path."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def __getitem__(self, grid):
        self.calls += 1
        return self.kernel[grid]


def _expected(x, n, shift, scale, square):
    rows = x[:n].float()
    return ((rows * rows if square else rows) * scale + shift % 1000).to(x.dtype)


def _case(dtype, offset, n, shift, square=False):
    base = torch.randn(64, device=DEVICE).to(dtype)
    x = base[offset:offset + 48]
    out = torch.zeros(48, dtype=dtype, device=DEVICE)
    args = (x, out, n, shift, 0.5)
    kwargs = dict(BLOCK=BLOCK, SQUARE=square)
    return x, out, args, kwargs


CASES = [(dtype, offset, n, shift)
         for dtype in (torch.float32, torch.bfloat16)
         for offset in (0, 1)  # an aligned and a misaligned address
         for n in (1, 16, 17)  # Triton's ints: equal to 1, divisible by 16, neither
         for shift in (3, 2 ** 40)]  # a do_not_specialize int: 32 bits or 64


@pytest.mark.parametrize("dtype,offset,n,shift", CASES, ids=str)
def test_direct_launches_compute_what_triton_does(dtype, offset, n, shift):
    launcher = Launcher(_affine_kernel)
    counting = launcher.kernel = _CountingKernel(_affine_kernel)
    x, out, args, kwargs = _case(dtype, offset, n, shift)
    grid = (triton.cdiv(n, BLOCK),)
    for _ in range(3):
        out.zero_()
        launcher[grid](*args, **kwargs)
        torch.testing.assert_close(out[:n], _expected(x, n, shift, 0.5, False), atol=0, rtol=0)
        assert not out[n:].any()
    assert counting.calls == 1, "only the first launch goes through Triton's path"


def test_each_specialisation_gets_the_kernel_triton_picks():
    """Launched in turn through one launcher, each case must find the CompiledKernel Triton's path returns for it:
    a key that merged two specialisations Triton tells apart would hand the later case the earlier one's kernel."""
    launcher = Launcher(_affine_kernel)
    picked = []
    for dtype, offset, n, shift in CASES:
        for square, num_warps in ((False, 4), (True, 4), (False, 1)):
            x, out, args, kwargs = _case(dtype, offset, n, shift, square)
            kwargs["num_warps"] = num_warps
            grid = (triton.cdiv(n, BLOCK),)
            launcher[grid](*args, **kwargs)
            launcher[grid](*args, **kwargs)
            torch.testing.assert_close(out[:n], _expected(x, n, shift, 0.5, square), atol=0, rtol=0)
            compiled = launcher.compiled(grid, args, kwargs)
            assert compiled is _affine_kernel[grid](*args, **kwargs)
            picked.append(compiled)
    assert len({id(kernel) for kernel in picked}) > len(CASES), "the cases must compile distinct kernels"


def test_a_launch_hook_sends_launches_through_triton():
    """A profiler's hook must see every launch: while one is set, nothing goes direct."""
    launcher = Launcher(_affine_kernel)
    counting = launcher.kernel = _CountingKernel(_affine_kernel)
    x, out, args, kwargs = _case(torch.float32, 0, 17, 3)
    grid = (1,)
    launcher[grid](*args, **kwargs)
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launcher[grid](*args, **kwargs)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    launcher[grid](*args, **kwargs)
    assert counting.calls == 2 and len(seen) == 1


def test_direct_launches_are_captured_by_cuda_graphs():
    launcher = Launcher(_affine_kernel)
    x, out, args, kwargs = _case(torch.float32, 0, 40, 3)
    grid = (2,)
    launcher[grid](*args, **kwargs)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launcher[grid](*args, **kwargs)
    x.copy_(torch.randn_like(x))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out[:40], _expected(x, 40, 3, 0.5, False), atol=0, rtol=0)


def test_positional_constexprs_are_refused():
    launcher = Launcher(_affine_kernel)
    x, out, args, kwargs = _case(torch.float32, 0, 17, 3)
    with pytest.raises(TypeError, match="positional"):
        launcher[(1,)](*args, BLOCK, False)


def test_eager_layers_take_the_fused_kernels_when_launched_directly(monkeypatch):
    """Eager steps take the fused elementwise kernels (an RMSNorm in one launch, not eight) only while launches go
    direct; through Triton's own path the torch ops cost an eager step less."""
    from loraplex.layers.kernels import fused_kernels_wanted

    assert fused_kernels_wanted(torch.device(DEVICE))
    monkeypatch.setenv("LORAPLEX_DIRECT_LAUNCH", "0")
    assert not fused_kernels_wanted(torch.device(DEVICE))
