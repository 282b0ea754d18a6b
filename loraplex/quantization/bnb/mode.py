"""bitsandbytes: LoRAX's `--quantize bitsandbytes | bitsandbytes-nf4 | bitsandbytes-fp4`, each linear set up
exactly as transformers' `BitsAndBytesConfig` sets it up, so that a model quantized here computes what
`from_pretrained(..., quantization_config=BitsAndBytesConfig(...))` computes on the same checkpoint (the parity
tests check it):

    bitsandbytes      BitsAndBytesConfig(load_in_8bit=True): LLM.int8, `Linear8bitLt(has_fp16_weights=False,
                      threshold=6.0)`; int8 weights with one scale per output row; activations quantized per row,
                      with the columns holding a value beyond 6.0 (outliers) computed unquantized
    bitsandbytes-nf4  BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bitsandbytes-fp4  bnb_4bit_compute_dtype=<the model's dtype>) (or "fp4"): `Linear4bit`, 4-bit weights in
                      blocks of 64 with one float32 absmax each (no double quantization, uint8 storage),
                      dequantized and multiplied in the compute dtype

On CUDA with Triton in float16/bfloat16, each layer bitsandbytes quantized then moves its weights, unchanged, into
our own layer (bnb/layers.py): the 4-bit modes compute what bitsandbytes computes; `bitsandbytes` multiplies its int8
weights weight-only (the activations unquantized, no outlier threshold: closer to the float model than LLM.int8).
Elsewhere (CPU) the bitsandbytes layers run as they are: there LLM.int8's outlier columns are chosen over all
rows of a step, so with `bitsandbytes` a request's logits can move slightly with what it is batched with (its
greedy tokens agree in the tests); the 4-bit modes keep rows independent.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used, as in the package
    import torch
    from torch import nn

MODES = ("bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4")
# transformers' default for BitsAndBytesConfig's llm_int8_threshold.
INT8_THRESHOLD = 6.0


def quantized_linear(bnb, linear: nn.Linear, mode: str, device: torch.device, compute_dtype: torch.dtype) -> nn.Module:
    """`linear` as the bitsandbytes layer of `mode` (`bnb`: the imported bitsandbytes), on `device`, same weights."""
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
    if _own_kernels(torch.device(device), compute_dtype):
        from loraplex.quantization.bnb.layers import from_bitsandbytes

        own = from_bitsandbytes(layer)
        if own is not None:
            return own.train(linear.training)
    keep_cpu_4bit_packable(layer)
    return layer.train(linear.training)


def _own_kernels(device: torch.device, compute_dtype: torch.dtype) -> bool:
    """Whether bitsandbytes' weights go into our own layers (bnb/layers.py): on CUDA with Triton, in 16-bit."""
    import torch

    from loraplex.kernels import triton_available

    return triton_available(device) and compute_dtype in (torch.float16, torch.bfloat16)


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


def is_bitsandbytes_linear(module: nn.Module) -> bool:
    """Whether `module` is a bitsandbytes linear (int8 or 4-bit)."""
    from torch import nn

    return type(module).__module__.startswith("bitsandbytes.") and isinstance(module, nn.Linear)


def is_int8(module: nn.Module) -> bool:
    """Whether a bitsandbytes linear is LLM.int8 (its weight carries row scales) rather than 4-bit."""
    return hasattr(module.weight, "SCB")


def dequantized(linear: nn.Linear) -> torch.Tensor:
    """A bitsandbytes layer's weight [out_features, in_features], dequantized (what its matmul multiplies by, up
    to LLM.int8's outlier columns)."""
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


def statistics(module: nn.Module) -> list[torch.Tensor | None]:
    """A bitsandbytes layer's quantization statistics (LLM.int8 row scales; 4-bit block absmax and code)."""
    weight = module.weight
    if hasattr(weight, "SCB"):  # int8: one scale per row, on the weight until the first forward, then on .state
        return [weight.SCB if weight.SCB is not None else module.state.SCB]
    if weight.quant_state is not None:  # 4-bit: one absmax per block, and the 16-value code
        return [weight.quant_state.absmax, weight.quant_state.code]
    return []


def quiet_int8_cast_warning() -> None:
    """bitsandbytes logs a warning on every LLM.int8 matmul whose input is not float16 (it quantizes activations
    through float16, as documented above): in a server that is one line per layer per step."""
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropInt8CastWarning) for f in logger.filters):
        logger.addFilter(_DropInt8CastWarning())


class _DropInt8CastWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("MatMul8bitLt: inputs will be cast from")
