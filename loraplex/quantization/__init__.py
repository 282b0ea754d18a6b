"""Weight quantization, two ways in:

- `--quantize MODE`, a load-time transform of a float checkpoint's linear layers, one module per mode
  (`bitsandbytes`: LoRAX's `--quantize bitsandbytes | bitsandbytes-nf4 | bitsandbytes-fp4`; `fp8`);
- a pre-quantized checkpoint (GPTQ, AWQ, compressed-tensors, FP8), read as published: `checkpoint_format`.

After our model is built and its weights loaded, `quantize_model` swaps its `nn.Linear`s, in place, for the
mode's own layers.

What stays unquantized, as with transformers: the output head (`lm_head`, transformers' default
`llm_int8_skip_modules`), a linear whose weight is shared with another module (tied), and what a model class
names in its `keep_unquantized` class attribute (module names matched on whole dotted components: "wo" keeps
every `...wo` linear, and anything inside a module named `wo`; T5 lists `wo`, transformers'
`_keep_in_fp32_modules`). Everything else is quantized, vision towers included: transformers 5 quantizes
LLaVA-NeXT's CLIP tower and multi-modal projector too (its skip list holds only the output embedding).

Run it before the LoRA wrappers go on (`load_model` does): `LoraLinear` then wraps the quantized layers like
any other linear (they are `nn.Linear` subclasses) and adds each adapter's delta, computed in the model's dtype,
to their output.

Embeddings, norms and the output head keep the model's dtype; `weight_bytes` tells what the weights take.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Callable

from loraplex.quantization.bnb import mode as bitsandbytes_mode
from loraplex.quantization.errors import QuantizationError

if TYPE_CHECKING:  # torch is imported where it is used: the CLI reads QUANTIZE_CHOICES without paying for it
    import torch
    from torch import nn

BITSANDBYTES_MODES = bitsandbytes_mode.MODES
FP8_MODE = "fp8"
QUANTIZE_CHOICES = (*bitsandbytes_mode.MODES, FP8_MODE)
# transformers' default for BitsAndBytesConfig: the output embedding it never quantizes.
ALWAYS_KEPT = ("lm_head",)


def check_quantize(mode: str, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
    """Raise QuantizationError (a ValueError) unless `mode` is known, bitsandbytes is installed and it can run
    `mode` on `device` in `dtype` (default float32), tried on a small layer: quantize, then one forward pass."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if mode not in QUANTIZE_CHOICES:
        raise QuantizationError(f"unknown --quantize {mode!r}; choose one of {', '.join(QUANTIZE_CHOICES)}")
    if mode == FP8_MODE:
        from loraplex.quantization.fp8 import mode as fp8

        fp8.check(torch.device(device), dtype)  # raises QuantizationError where FP8 cannot run
        return
    bnb = _library(mode)
    failure = _probe(mode, str(torch.device(device)), dtype)
    if failure is not None:
        raise QuantizationError(
            f"--quantize {mode}: bitsandbytes {bnb.__version__} cannot run it on {device} "
            f"({str(dtype).removeprefix('torch.')}): {failure}"
        )


def _library(mode: str):
    try:
        import bitsandbytes
    except ImportError as exc:
        raise QuantizationError(f"--quantize {mode} needs bitsandbytes: pip install bitsandbytes ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - a broken install (missing native library, ...) raises anything
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise QuantizationError(f"--quantize {mode}: bitsandbytes is installed but fails to import: {first}") from None
    return bitsandbytes


@functools.lru_cache(maxsize=None)
def _probe(mode: str, device: str, dtype: torch.dtype) -> str | None:
    """None when a small layer quantizes and runs on `device`; else the error, on one line."""
    import torch
    from torch import nn

    try:
        with warnings.catch_warnings():  # a failing probe may warn on its way: the error says it all
            warnings.simplefilter("ignore")
            gen = torch.Generator().manual_seed(0)  # not the global generator: a check must not move anyone's seed
            layer = nn.Linear(128, 64, bias=True, device="meta")
            layer.weight = nn.Parameter(torch.randn(64, 128, generator=gen).div(12).to(dtype), requires_grad=False)
            layer.bias = nn.Parameter(torch.randn(64, generator=gen).to(dtype), requires_grad=False)
            model = nn.Sequential(layer).eval()
            quantize_model(model, mode, device, dtype, skip=lambda name: False)
            with torch.inference_mode():
                out = model(torch.randn(3, 128, generator=gen).to(device=device, dtype=dtype))
    except Exception as exc:  # noqa: BLE001 - whatever stops it is what the user must read
        text = " ".join(str(exc).split()) or type(exc).__name__
        return text if len(text) <= 300 else text[:297] + "..."
    if out.shape != (3, 64) or not torch.isfinite(out).all():
        return f"a test layer computed {'a wrong shape' if out.shape != (3, 64) else 'non-finite values'}"
    return None


def default_skip(model: nn.Module) -> Callable[[str], bool]:
    """The linears transformers leaves unquantized: the output head and each module class's `keep_unquantized`."""
    keep = set(ALWAYS_KEPT)
    for module in model.modules():
        keep.update(getattr(type(module), "keep_unquantized", ()))
    return lambda name: any(f".{key}." in f".{name}." for key in keep)


def quantize_model(
    model: nn.Module,
    mode: str,
    device: torch.device | str,
    compute_dtype: torch.dtype,
    skip: Callable[[str], bool] | None = None,
) -> int:
    """Replace each plain `nn.Linear` of `model` (module name not skipped) by its bitsandbytes equivalent for
    `mode`, on `device`, with the same weights and biases; returns how many were replaced.

    `skip(name)` True keeps that linear as it is; None: `default_skip(model)`. Linears whose weight another
    module shares (tied) are always kept. The weights may be on any device: they are quantized on `device`.
    """
    import torch
    from torch import nn

    if mode not in QUANTIZE_CHOICES:
        raise QuantizationError(f"unknown --quantize {mode!r}; choose one of {', '.join(QUANTIZE_CHOICES)}")
    if mode == FP8_MODE:
        from loraplex.quantization.fp8 import mode as fp8

        quantized_linear = lambda linear: fp8.quantize_linear(linear, device, compute_dtype)  # noqa: E731
    else:
        bnb = _library(mode)
        quantized_linear = lambda linear: bitsandbytes_mode.quantized_linear(  # noqa: E731
            bnb, linear, mode, device, compute_dtype)
    if mode == "bitsandbytes":
        bitsandbytes_mode.quiet_int8_cast_warning()
    device = torch.device(device)
    skip = default_skip(model) if skip is None else skip
    owners: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    # Names only: holding the modules would keep every float weight alive until the last one is quantized.
    names = [
        name for name, module in model.named_modules()
        if type(module) is nn.Linear and not skip(name) and owners.get(id(module.weight), 0) == 1
    ]
    with torch.no_grad():
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, quantized_linear(getattr(parent, child)))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the float weights are gone: let free-memory figures (KV sizing) see it
    return len(names)


def move_unquantized(model: nn.Module, device: torch.device | str) -> None:
    """Move every parameter and buffer not held by a bitsandbytes layer to `device` (embeddings, norms, the
    head: what quantization leaves in float), keeping tied tensors tied. The quantized layers are already
    on their device; `.to()` on them would re-wrap their state."""
    import torch
    from torch import nn

    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if is_quantized(module):
            continue
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is None or tensor.device == target:
                    continue
                if id(tensor) not in moved:
                    data = tensor.detach().to(target)
                    moved[id(tensor)] = nn.Parameter(data, requires_grad=False) if isinstance(tensor, nn.Parameter) else data
                table[key] = moved[id(tensor)]


def graph_blocker(model: nn.Module) -> str | None:
    """Why decode steps of `model` cannot be captured in CUDA graphs, or None: LLM.int8 picks its outlier
    columns on the host at every matmul (a device-to-host read, which a capture cannot hold)."""
    for module in model.modules():
        if bitsandbytes_mode.is_bitsandbytes_linear(module) and bitsandbytes_mode.is_int8(module):
            return "--quantize bitsandbytes (LLM.int8) reads its outlier columns on the host at every matmul"
    return None


def _own_quantized(module: nn.Module) -> bool:
    """Whether `module` is one of our own quantized linears (FP8, W4A16), not a bitsandbytes one."""
    from loraplex.quantization.layer import QuantizedLinear

    return isinstance(module, QuantizedLinear)


def is_quantized(module: nn.Module) -> bool:
    """Whether `module` is a quantized linear (of any mode or checkpoint format)."""
    return _own_quantized(module) or bitsandbytes_mode.is_bitsandbytes_linear(module)


def dequantized_weight(linear: nn.Linear) -> torch.Tensor:
    """A linear's weight [out_features, in_features] as floats: its own weight, or a quantized layer's weight
    dequantized (what its matmul multiplies by, up to LLM.int8's outlier columns)."""
    if _own_quantized(linear):
        return linear.dequantized()
    if not is_quantized(linear):
        return linear.weight
    return bitsandbytes_mode.dequantized(linear)


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take on their devices: every parameter and buffer once (tied ones once), plus
    the quantized layers' statistics (bitsandbytes: LLM.int8 row scales, 4-bit block absmax and code)."""
    seen: set[int] = set()
    total = 0

    def count(tensor: torch.Tensor | None) -> None:
        nonlocal total
        if tensor is not None and id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()

    for tensor in [*model.parameters(), *model.buffers()]:
        count(tensor)
    for module in model.modules():
        if _own_quantized(module):
            for tensor in module.quantized_tensors():
                count(tensor)
        elif is_quantized(module):
            for tensor in bitsandbytes_mode.statistics(module):
                count(tensor)
    return total
