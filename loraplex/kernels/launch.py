"""A cheaper way to launch a Triton kernel eagerly: `Launcher(kernel)[grid](*args, **kwargs)` does what
`kernel[grid](*args, **kwargs)` does, with less host time.

Triton's own launch path binds the arguments, builds a string key of the options, makes launch metadata and checks
hooks on every call, several times what the compiled kernel's own launcher takes. A Launcher keeps, per
specialisation key, the `CompiledKernel` that Triton's path returned the first time (compiling it there, with every
check Triton makes) and launches it directly after that. Eager steps make a few such calls per layer;
`python -m benchmarks.lora_host_costs` measures both paths (figures in docs/benchmarks.md).

The key holds what Triton specialises a kernel on, computed the way Triton computes it: each tensor's dtype and
whether its address is 16-byte aligned; each other argument through Triton's own `native_specialize_impl` (ints:
equal to 1, divisible by 16, 32 or 64 bits; a `do_not_specialize` int only its width); each constexpr's value; the
launch options (num_warps, ...); the device. tests/gpu/test_gpu_launch.py checks that the kernel it picks is the
one Triton's path picks. Whenever a launch hook is set (a profiler such as proton), or the kernel is not a compiled
`JITFunction` (TRITON_INTERPRET=1), or LORAPLEX_DIRECT_LAUNCH=0 (to compare, or should a Triton release change what
this rests on), every call goes through Triton's path.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from triton import knobs
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction

from loraplex.kernels import direct_launches

try:  # Triton's own specialisation of one argument (C++); absent from older releases
    from triton._C.libtriton import native_specialize_impl
except ImportError:  # pragma: no cover - the direct path is then off
    native_specialize_impl = None


def _hooked(hook: Any) -> bool:
    """Whether a launch hook would run: Triton 3.6 keeps a HookChain there, never None, that is empty unless set."""
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None


class Launcher:
    """Launches one `triton.jit` kernel; constexpr parameters must come after every other parameter and be passed
    by name, as this codebase's kernels do."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.direct = isinstance(kernel, JITFunction) and native_specialize_impl is not None and direct_launches()
        self._compiled: dict[tuple, Any] = {}
        if not self.direct:
            return
        params = kernel.params
        self._runtime = [p for p in params if not p.is_constexpr]
        self._constexprs = [p.name for p in params if p.is_constexpr]
        if any(p.num > len(self._runtime) - 1 for p in self._runtime):
            raise ValueError(f"{kernel.fn.__name__}: constexpr parameters must come last")
        # Per runtime parameter: what Triton specialises it on.
        self._specialize = [not p.do_not_specialize for p in self._runtime]
        self._align = [not p.do_not_specialize_on_alignment for p in self._runtime]

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def key(self, args: tuple, kwargs: dict[str, Any]) -> tuple:
        """What selects the compiled kernel for these arguments (see the module's docstring)."""
        spec = []
        for value, specialize, align in zip(args, self._specialize, self._align):
            if isinstance(value, torch.Tensor):
                spec.append((value.dtype, align and value.data_ptr() % 16 == 0))
            else:
                spec.append(native_specialize_impl(BaseBackend, value, False, specialize, align))
        # kwargs in call order, names kept: another order makes at worst a second entry for the same kernel
        return (torch.cuda.current_device(), tuple(spec), tuple(kwargs.items()))

    def compiled(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> Any:
        """The CompiledKernel a direct launch would use for these arguments, or None before the first launch."""
        return self._compiled.get(self.key(args, kwargs))

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        if not self.direct or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            self.kernel[grid](*args, **kwargs)
            return
        if len(args) != len(self._runtime):
            raise TypeError(f"{self.kernel.fn.__name__}: {len(self._runtime)} positional arguments wanted, "
                            f"{len(args)} given")
        key = self.key(args, kwargs)
        compiled = self._compiled.get(key)
        if compiled is None:  # Triton's path compiles (or loads) and launches it; later calls go direct
            compiled = self.kernel[grid](*args, **kwargs)
            if hasattr(compiled, "result"):  # an asynchronous compile's future
                compiled = compiled.result()
            self._compiled[key] = compiled
            return
        constexprs = [kwargs[name] for name in self._constexprs]
        stream = torch._C._cuda_getCurrentRawStream(key[0])
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *constexprs)


__all__ = ["Launcher"]
