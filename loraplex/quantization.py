"""Weight quantization with bitsandbytes: LoRAX's `--quantize bitsandbytes | bitsandbytes-nf4 | bitsandbytes-fp4`.

After our model is built and its weights loaded, `quantize_model` swaps its `nn.Linear`s, in place, for
bitsandbytes' own layers, set up exactly as transformers' `BitsAndBytesConfig` sets them up, so that a model
quantized here computes what `from_pretrained(..., quantization_config=BitsAndBytesConfig(...))` computes on the
same checkpoint (the parity tests check it):

    bitsandbytes      BitsAndBytesConfig(load_in_8bit=True): LLM.int8, `Linear8bitLt(has_fp16_weights=False,
                      threshold=6.0)`; int8 weights with one scale per output row; activations quantized per row,
                      with the columns holding a value beyond 6.0 (outliers) computed unquantized
    bitsandbytes-nf4  BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bitsandbytes-fp4  bnb_4bit_compute_dtype=<the model's dtype>) (or "fp4"): `Linear4bit`, 4-bit weights in
                      blocks of 64 with one float32 absmax each (no double quantization, uint8 storage),
                      dequantized and multiplied in the compute dtype

What stays unquantized, as with transformers: the output head (`lm_head`, transformers' default
`llm_int8_skip_modules`), a linear whose weight is shared with another module (tied), and what a model class
names in its `keep_unquantized` class attribute (module names matched on whole dotted components: "wo" keeps
every `...wo` linear, and anything inside a module named `wo`; T5 lists `wo`, transformers'
`_keep_in_fp32_modules`). Everything else is quantized, vision towers included: transformers 5 quantizes
LLaVA-NeXT's CLIP tower and multi-modal projector too (its skip list holds only the output embedding).

Run it before the LoRA wrappers go on (`load_model` does): `LoraLinear` then wraps the bitsandbytes layers like
any other linear (they are `nn.Linear` subclasses) and adds each adapter's delta, computed in the model's dtype,
to their output.

Embeddings, norms and the output head keep the model's dtype; `weight_bytes` tells what the weights take.
LLM.int8's outlier columns are chosen over all rows of a step, so with `bitsandbytes` a request's logits can
move slightly with what it is batched with (its greedy tokens agree in the tests); the 4-bit modes keep rows
independent.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch is imported where it is used: the CLI reads QUANTIZE_CHOICES without paying for it
    import torch
    from torch import nn

QUANTIZE_CHOICES = ("bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4")
# transformers' defaults for BitsAndBytesConfig: llm_int8_threshold, and the output embedding it never quantizes.
INT8_THRESHOLD = 6.0
ALWAYS_KEPT = ("lm_head",)


class QuantizationError(ValueError):
    """A --quantize setting that cannot be served here; the message says why (one line, for the user)."""


def check_quantize(mode: str, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
    """Raise QuantizationError (a ValueError) unless `mode` is known, bitsandbytes is installed and it can run
    `mode` on `device` in `dtype` (default float32), tried on a small layer: quantize, then one forward pass."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if mode not in QUANTIZE_CHOICES:
        raise QuantizationError(f"unknown --quantize {mode!r}; choose one of {', '.join(QUANTIZE_CHOICES)}")
    bnb = _bitsandbytes(mode)
    failure = _probe(mode, str(torch.device(device)), dtype)
    if failure is not None:
        raise QuantizationError(
            f"--quantize {mode}: bitsandbytes {bnb.__version__} cannot run it on {device} "
            f"({str(dtype).removeprefix('torch.')}): {failure}"
        )


def _bitsandbytes(mode: str):
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
    bnb = _bitsandbytes(mode)
    if mode == "bitsandbytes":
        _quiet_int8_cast_warning()
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
            setattr(parent, child, _quantized(bnb, getattr(parent, child), mode, device, compute_dtype))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the float weights are gone: let free-memory figures (KV sizing) see it
    return len(names)


def _quantized(bnb, linear: nn.Linear, mode: str, device: torch.device, compute_dtype: torch.dtype) -> nn.Module:
    import torch
    from torch import nn

    has_bias = linear.bias is not None
    weight = linear.weight.detach()
    with torch.device("meta"):  # no throwaway initialisation: the weights come next
        if mode == "bitsandbytes":
            layer = bnb.nn.Linear8bitLt(
                linear.in_features, linear.out_features, has_bias, has_fp16_weights=False, threshold=INT8_THRESHOLD
            )
        else:
            layer = bnb.nn.Linear4bit(
                linear.in_features, linear.out_features, has_bias, compute_dtype=compute_dtype,
                compress_statistics=False, quant_type=mode.rsplit("-", 1)[1], quant_storage=torch.uint8,
            )
    if mode == "bitsandbytes":
        # What Int8Params does when moved from the CPU (transformers' path), done on the device: the weights may
        # already be there, and Int8Params quantizes only on a move from the CPU.
        cb, scb, _ = bnb.functional.int8_vectorwise_quant(weight.to(device=device, dtype=torch.float16).contiguous())
        layer.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)
    else:
        params = bnb.nn.Params4bit(
            weight, requires_grad=False, blocksize=64, compress_statistics=False,
            quant_type=layer.weight.quant_type, quant_storage=torch.uint8, module=layer,
        )
        layer.weight = params.to(device)  # Params4bit quantizes on its move to a device
    if has_bias:
        layer.bias = nn.Parameter(linear.bias.detach().to(device), requires_grad=False)
    keep_cpu_4bit_packable(layer)
    return layer.train(linear.training)


# bitsandbytes' packed 4-bit CPU kernel (CPUs with AVX512-BF16) repacks a Linear4bit's weight at its first forward
# and fails unless out_features is a multiple of this and in_features of the quantization block size.
_CPU_PACK_BLOCK_N = 32


def keep_cpu_4bit_packable(module: nn.Module) -> None:
    """Send the bitsandbytes Linear4bit layers in `module` whose shapes its packed CPU kernel cannot take (tiny
    or odd sizes) to its generic CPU path: on an AVX512-BF16 CPU they would fail at their first forward."""
    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        state = getattr(weight, "quant_state", None)
        if not getattr(layer, "support_avx512bf16_for_cpu", False) or state is None:
            continue
        out_features, in_features = state.shape
        if out_features % _CPU_PACK_BLOCK_N or in_features % state.blocksize:
            layer.support_avx512bf16_for_cpu = False


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


def is_quantized(module: nn.Module) -> bool:
    """Whether `module` is a bitsandbytes linear (int8 or 4-bit)."""
    from torch import nn

    return type(module).__module__.startswith("bitsandbytes.") and isinstance(module, nn.Linear)


def dequantized_weight(linear: nn.Linear) -> torch.Tensor:
    """A linear's weight [out_features, in_features] as floats: its own weight, or a bitsandbytes layer's
    weight dequantized (what its matmul multiplies by, up to LLM.int8's outlier columns)."""
    if not is_quantized(linear):
        return linear.weight
    import bitsandbytes as bnb

    weight = linear.weight
    if isinstance(weight, bnb.nn.Int8Params):
        scb = weight.SCB if weight.SCB is not None else linear.state.SCB
        return bnb.functional.int8_vectorwise_dequant(weight.data, scb)
    state = weight.quant_state
    data = weight.data
    if getattr(state, "packing_format_for_cpu", False):  # repacked for AVX512-BF16 CPUs at the first forward
        from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse

        data, state = _convert_weight_packed_for_cpu_inverse(data.clone(), state)
    return bnb.functional.dequantize_4bit(data, state)


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take on their devices: every parameter and buffer once (tied ones once), plus
    bitsandbytes' quantization statistics (LLM.int8 row scales, 4-bit block absmax and code)."""
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
        if not is_quantized(module):
            continue
        weight = module.weight
        if hasattr(weight, "SCB"):  # int8: one scale per row, on the weight until the first forward, then on .state
            count(weight.SCB if weight.SCB is not None else module.state.SCB)
        elif weight.quant_state is not None:  # 4-bit: one absmax per block, and the 16-value code
            count(weight.quant_state.absmax)
            count(weight.quant_state.code)
    return total


def _quiet_int8_cast_warning() -> None:
    """bitsandbytes logs a warning on every LLM.int8 matmul whose input is not float16 (it quantizes activations
    through float16, as documented above): in a server that is one line per layer per step."""
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropInt8CastWarning) for f in logger.filters):
        logger.addFilter(_DropInt8CastWarning())


class _DropInt8CastWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("MatMul8bitLt: inputs will be cast from")
