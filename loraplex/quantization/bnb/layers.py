"""Our own layers for bitsandbytes' weights on CUDA (`--quantize bitsandbytes | bitsandbytes-nf4 |
bitsandbytes-fp4` with Triton): bitsandbytes quantizes each linear, so the stored bits are its own, and
`from_bitsandbytes` then moves them, unchanged, into one of these layers. Unlike bitsandbytes' layers they fuse
q/k/v and gate/up (one product), never read the device from the host (CUDA graphs capture them) and give each row
a result that does not depend on its batch.

`Int8Linear`: the 8-bit weights of LLM.int8 (int8 [N, K], one absmax per output row: w = q * absmax / 127),
multiplied weight-only (W8A16, as LoRAX's EETQ mode) by weight_only's Triton kernels for up to 64 rows (decode):
the activations stay in the compute dtype. LLM.int8 instead
quantizes each activation row to int8, except the columns holding a value beyond its threshold (outliers), which
it multiplies in float16; that product approximates this one, which is exact up to the weight's rounding. So on
CUDA `--quantize bitsandbytes` is closer to the float model than transformers' LLM.int8 on the same checkpoint
(tests/gpu/test_gpu_quantization.py measures both).

`FourBitLinear`: nf4/fp4 as bitsandbytes stores them (two codes per byte, the even input feature in the high
nibble; one float32 absmax per 64 consecutive input features; the 16-value code book), multiplied on CUDA by
bitsandbytes' own kernels as its layer calls them: its gemv for one row, else its dequantization into the compute
dtype (code[q] * absmax, rounded once) and a 16-bit product. A Triton kernel of ours that looked each code up as it
read the weight measured slower than both (the look-ups bound it: 0.76x bf16 at one row, 0.17x at 32, on an H200's
8B layer; docs/benchmarks.md).

Products of more rows than the int8 kernels take (prefill) dequantize the weight into the compute dtype and
multiply. Both layers have a plain-PyTorch reference path (CPU), which the CPU tests check against bitsandbytes'
own dequantization.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from loraplex.kernels import triton_available
from loraplex.quantization.layer import QuantizedLinear, common_key, frozen, fuse_by_channel

FOUR_BIT_BLOCK = 64  # input features per absmax: bitsandbytes' blocksize, which quantized_linear sets
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


class _ChannelRowsLinear(QuantizedLinear):
    """What both layers share: tensors stacked by output channel (dim 0), so siblings fuse by concatenation, and
    `forward` over x's rows as one matrix (`product`, the subclass's)."""

    TENSORS: tuple[str, ...] = ()  # the per-channel tensors, in the constructor's order
    SHARED: tuple[str, ...] = ()  # tensors every channel reads (the code book), kept as they are by fuse_siblings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.dequantized().to(rows.dtype), self.bias)

    @classmethod
    def fuse_siblings(cls, linears: list[nn.Module]):
        """One layer computing `linears` (siblings reading one input) in one product, their outputs concatenated in
        order; each sibling's tensors become views of the fused layer's. None when they cannot fuse (another kind,
        options or code book)."""
        first = linears[0]
        shared = [getattr(first, name) for name in cls.SHARED]
        if any(not torch.equal(getattr(linear, name), getattr(first, name)) for linear in linears[1:]
               for name in cls.SHARED if type(linear) is cls):
            return None
        return fuse_by_channel(cls, linears, cls.TENSORS, lambda lin: (common_key(lin), lin._fuse_key()),
                               lambda stacked, bias: cls(*stacked, *shared, bias=bias, **first._init_options()))

    def _fuse_key(self) -> tuple:
        return ()

    def _init_options(self) -> dict:
        return {}


class Int8Linear(_ChannelRowsLinear):
    """weight int8 [N, K], weight_scale float32 [N] (the row's absmax / 127): w = weight * weight_scale."""

    TENSORS = ("weight", "weight_scale")

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias=False)
        if weight.dtype != torch.int8 or weight_scale.shape != (out_features,):
            raise ValueError(f"an int8 layer needs int8 [N, K] and scales [N], not {weight.dtype} {tuple(weight.shape)}"
                             f" and {tuple(weight_scale.shape)}")
        self.weight = frozen(weight.contiguous())
        self.weight_scale = frozen(weight_scale.to(torch.float32).contiguous())
        self.bias = None if bias is None else frozen(bias)

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if triton_available(rows.device) and rows.dtype in KERNEL_DTYPES and self.in_features % 128 == 0:
            import loraplex.quantization.weight_only as weight_only

            if 0 < rows.shape[0] <= weight_only.max_rows():
                return weight_only.matmul(rows, self.weight, self.weight_scale, self.bias)
        return super().product(rows)


class FourBitLinear(_ChannelRowsLinear):
    """weight uint8 [N, K/2] (two codes per byte, high nibble first), absmax float32 [N, K/64], code float32 [16]
    (the nf4 or fp4 values): w[n, k] = code[q[n, k]] * absmax[n, k // 64]."""

    TENSORS = ("weight", "absmax")
    SHARED = ("code",)

    def __init__(self, weight: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, bias: torch.Tensor | None = None,
                 quant_type: str = "nf4") -> None:
        out_features, half = weight.shape
        in_features = 2 * half
        super().__init__(in_features, out_features, bias=False)
        if (weight.dtype != torch.uint8 or in_features % FOUR_BIT_BLOCK
                or absmax.shape != (out_features, in_features // FOUR_BIT_BLOCK) or code.numel() != 16):
            raise ValueError(f"a 4-bit layer needs uint8 [N, K/2] with K a multiple of {FOUR_BIT_BLOCK}, absmax "
                             f"[N, K/{FOUR_BIT_BLOCK}] and a 16-value code, not {weight.dtype} {tuple(weight.shape)}, "
                             f"{tuple(absmax.shape)} and {code.numel()} values")
        self.quant_type = quant_type
        self.weight = frozen(weight.contiguous())
        self.absmax = frozen(absmax.to(torch.float32).contiguous())
        self.code = frozen(code.to(device=weight.device, dtype=torch.float32).contiguous())
        self.bias = None if bias is None else frozen(bias)

    def codes(self) -> torch.Tensor:
        """The 4-bit codes [N, K] (uint8), in input-feature order."""
        return torch.stack((self.weight >> 4, self.weight & 15), dim=-1).reshape(self.out_features, self.in_features)

    def dequantized(self) -> torch.Tensor:
        scale = self.absmax.repeat_interleave(FOUR_BIT_BLOCK, dim=1)
        return self.code[self.codes().long()] * scale

    def dequantized_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in `dtype`, as the product multiplies by it (on CUDA bitsandbytes' dequantization)."""
        if self.weight.is_cuda and dtype in KERNEL_DTYPES:
            return torch.ops.bitsandbytes.dequantize_4bit.default(
                self.weight.view(-1, 1), self.absmax.view(-1), FOUR_BIT_BLOCK, self.quant_type,
                [self.out_features, self.in_features], dtype)
        return self.dequantized().to(dtype)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] == 1 and rows.is_cuda and rows.dtype in KERNEL_DTYPES:  # bitsandbytes' gemv
            out = torch.ops.bitsandbytes.gemv_4bit.default(
                rows, self.weight.view(-1, 1), [self.out_features, self.in_features], self.absmax.view(-1), self.code,
                FOUR_BIT_BLOCK)
            return out if self.bias is None else out + self.bias
        return F.linear(rows, self.dequantized_as(rows.dtype), self.bias)

    def quantized_tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.absmax, self.code]

    def _fuse_key(self) -> tuple:
        return (self.quant_type,)

    def _init_options(self) -> dict:
        return {"quant_type": self.quant_type}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, quant_type={self.quant_type}"


def from_bitsandbytes(layer: nn.Module) -> QuantizedLinear | None:
    """A bitsandbytes Linear8bitLt or Linear4bit (as bitsandbytes.quantized_linear builds them) as our layer with the
    same stored weights (views, not copies), or None when its layout is not one ours reads (4-bit blocks that
    straddle rows, double quantization, other block sizes)."""
    weight = layer.weight
    bias = None if layer.bias is None else layer.bias.detach()
    if hasattr(weight, "SCB"):
        scb = weight.SCB if weight.SCB is not None else layer.state.SCB
        # 1 / 127 as bitsandbytes' int8_vectorwise_dequant writes it (it multiplies by scb first, then by this).
        return Int8Linear(weight.data, scb.float() * 7.874015718698502e-3, bias)
    state = getattr(weight, "quant_state", None)
    if (state is None or state.nested or state.blocksize != FOUR_BIT_BLOCK or getattr(state, "packing_format_for_cpu", False)
            or weight.dtype != torch.uint8):
        return None
    out_features, in_features = state.shape
    if in_features % FOUR_BIT_BLOCK:
        return None
    packed = weight.data.view(out_features, in_features // 2)
    absmax = state.absmax.view(out_features, in_features // FOUR_BIT_BLOCK)
    return FourBitLinear(packed, absmax, state.code, bias, quant_type=state.quant_type)
