"""W4A16: 4-bit integer weights, 16-bit activations. One layer, `W4A16Linear`, that every 4-bit checkpoint format
(GPTQ, AWQ, compressed-tensors pack-quantized: `w4a16/formats.py`) converts into at load.

The weight is w[n, k] = (q[k, n] - zero[g, n]) * scale[g, n] with q in 0..15, g = k's group (groups of 32, 64 or 128
consecutive input features; a per-channel checkpoint is one group per column, stored here as groups of 128 with
repeated scales when the input width allows). A GPTQ act-order checkpoint assigns input features to groups in another
order (its g_idx): at load the features are sorted by group (`perm`), the weight's rows taken in that order and x's
columns gathered the same way at each call, so that the groups are contiguous for the kernel (as Marlin and exllama
do); `dequantized()` gives the weight back in the original column order.

The packed form (`qweight`, int32 [K/8, N]): within each block of `pack_block` input features, word r of column n
holds, in its nibble j (bits 4j..4j+3), feature j * (pack_block / 8) + r. The Triton kernel reads blocks of 128 so
that nibble j of 16 consecutive words is 16 consecutive features: one shift per nibble, no shuffle. Blocks of 8 are
plain sequential packing (for layers whose input width is not a multiple of 128: the reference path reads them).

Forward: on CUDA the kernel `KERNEL` names (set by measurement: benchmarks/w4a16_kernels.py); elsewhere, or where a
kernel cannot take the layer, dequantize-then-matmul.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from loraplex.kernels import triton_available
from loraplex.quantization.layer import QuantizedLinear

# The CUDA kernel: "triton" (our dequantize-GEMM, w4a16_triton), "tinygemm" (PyTorch core's
# _weight_int4pack_mm, bfloat16 only; w4a16_tinygemm) or "reference" (dequantize, then F.linear).
KERNEL = "triton"
KERNEL_BLOCK = 128  # input features per packed block the Triton kernel reads
KERNEL_GROUPS = (32, 64, 128)


def pack_int4(q: torch.Tensor, pack_block: int) -> torch.Tensor:
    """q [K, N] (integers 0..15) -> int32 [K/8, N] in the blocked nibble order of this module's docstring."""
    k, n = q.shape
    words = pack_block // 8
    # [blocks, nibble j, word r, N] -> [blocks, word r, nibble j, N]
    nibbles = q.to(torch.int32).reshape(k // pack_block, 8, words, n).transpose(1, 2)
    shifts = (torch.arange(8, dtype=torch.int32, device=q.device) * 4).view(1, 1, 8, 1)
    # Nibbles occupy disjoint bits, so their sum is their bitwise or; int32 wraps the top nibble into the sign.
    return (nibbles << shifts).sum(dim=2, dtype=torch.int32).reshape(k // 8, n)


def unpack_int4(packed: torch.Tensor, pack_block: int) -> torch.Tensor:
    """The inverse of `pack_int4`: int32 [K/8, N] -> uint8 [K, N]."""
    k8, n = packed.shape
    words = pack_block // 8
    shifts = (torch.arange(8, dtype=torch.int32, device=packed.device) * 4).view(1, 1, 8, 1)
    nibbles = (packed.reshape(k8 // words, words, 1, n) >> shifts) & 0xF  # [blocks, word r, nibble j, N]
    return nibbles.transpose(1, 2).reshape(k8 * 8, n).to(torch.uint8)


def act_order_permutation(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The input-feature order that makes g_idx's groups contiguous, or None when they already are (no act-order).
    A ValueError when its groups are not `group_size` features each."""
    k = g_idx.numel()
    g_idx = g_idx.to(torch.int64)
    contiguous = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx, contiguous):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], contiguous):
        raise ValueError(f"g_idx does not assign {group_size} input features to each of {k // group_size} groups")
    return perm


class W4A16Linear(QuantizedLinear):
    """A linear whose weight is 4-bit integers with per-group scales and zero points (see the module's docstring).

    Its tensors are non-persistent buffers: the format readers build them from the checkpoint's own tensors, which
    the strict loader never sees. `bias`, if any, is a parameter the strict loader fills.
    """

    def __init__(self, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 g_idx: torch.Tensor | None, bias: bool, device: torch.device, dtype: torch.dtype) -> None:
        """q [K, N] integers 0..15; zeros and scales [K / group_size, N] (zeros: integers, any dtype); g_idx [K]
        (each input feature's group) or None for consecutive groups; everything in the original feature order."""
        k, n = q.shape
        super().__init__(k, n, bias, device=device, dtype=dtype)
        q, zeros, scales = q.to(device), zeros.to(device), scales.to(device)
        perm = act_order_permutation(g_idx.to(device), group_size) if g_idx is not None else None
        if perm is not None:
            q = q[perm]
        if group_size > KERNEL_BLOCK and group_size % KERNEL_BLOCK == 0:  # per-channel: groups of 128, same values
            repeat = group_size // KERNEL_BLOCK
            zeros, scales, group_size = zeros.repeat_interleave(repeat, 0), scales.repeat_interleave(repeat, 0), 128
        self.group_size = group_size
        self.pack_block = KERNEL_BLOCK if k % KERNEL_BLOCK == 0 else 8
        self.register_buffer("perm", perm.to(torch.int32) if perm is not None else None, persistent=False)
        # Scales keep a 16-bit stored dtype (GPTQ's and AWQ's fp16 in a bf16 model: dequantized() stays exact; the
        # kernels read them as float32); other dtypes take the compute dtype.
        scale_dtype = scales.dtype if scales.dtype in (torch.float16, torch.bfloat16) else dtype
        self.register_buffer("scales", scales.to(scale_dtype).contiguous(), persistent=False)
        # Integers up to 16 (GPTQ v1 stores zero - 1): exact in every float dtype.
        self.register_buffer("zeros", zeros.to(dtype).contiguous(), persistent=False)
        self.kernel = _kernel_for(self, q.device, dtype)
        if self.kernel == "tinygemm":
            from loraplex.quantization.w4a16 import tinygemm as w4a16_tinygemm

            self.register_buffer("qweight", None, persistent=False)
            tensors = w4a16_tinygemm.pack(q, self.zeros, self.scales)
            self.register_buffer("int4pack", tensors[0], persistent=False)
            self.register_buffer("scale_and_zeros", tensors[1], persistent=False)
        else:
            self.register_buffer("qweight", pack_int4(q, self.pack_block), persistent=False)
        counters = None
        if self.kernel == "triton":
            from loraplex.quantization.split_k import split_counters

            counters = split_counters(q.device)
        self.register_buffer("split_counters", counters, persistent=False)

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int = 128, symmetric: bool = False,
                   device: torch.device | None = None, dtype: torch.dtype | None = None) -> "W4A16Linear":
        """A float linear rounded to 4 bits (round-to-nearest, `quantize_groups`): for benchmarks and tests of
        shapes no checkpoint is at hand for (checkpoints come quantized by GPTQ or AWQ, which round better)."""
        weight = linear.weight.detach()
        device = weight.device if device is None else torch.device(device)
        dtype = weight.dtype if dtype is None else dtype
        q, zeros, scales = quantize_groups(weight.to(device), group_size, symmetric)
        layer = cls(q, zeros, scales, group_size, None, linear.bias is not None, device, dtype)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
        return layer

    @property
    def fused_anchor(self) -> torch.Tensor | None:
        """The tensor whose storage tells fused siblings' tensors apart from replaced ones (layers/projections.py)."""
        return self.qweight

    @classmethod
    def fuse_siblings(cls, linears: list[nn.Module]) -> "W4A16Linear | None":
        """One layer computing `linears` (siblings reading one input) in one product, their outputs concatenated
        in order; each sibling's tensors become column views of the fused layer's (no second copy). None when they
        cannot fuse: another kind, groups or dtypes that differ, act-order (each sibling sorts its inputs its own
        way), or tinygemm's packing (not sliceable by columns)."""
        first = linears[0]
        if not all(type(linear) is cls for linear in linears) or first.kernel == "tinygemm":
            return None
        if len({(lin.in_features, lin.group_size, lin.pack_block, lin.kernel, lin.perm is None, lin.bias is None,
                 lin.scales.dtype, lin.zeros.dtype, lin.qweight.device) for lin in linears}) != 1 or first.perm is not None:
            return None
        fused = cls.__new__(cls)
        QuantizedLinear.__init__(fused, first.in_features, sum(lin.out_features for lin in linears), False)
        fused.group_size, fused.pack_block, fused.kernel = first.group_size, first.pack_block, first.kernel
        with torch.no_grad():
            for name in ("qweight", "scales", "zeros"):
                fused.register_buffer(name, torch.cat([getattr(lin, name) for lin in linears], dim=1), persistent=False)
            bias = None if first.bias is None else torch.cat([lin.bias for lin in linears])
        fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        fused.register_buffer("perm", None, persistent=False)
        fused.register_buffer("split_counters", first.split_counters, persistent=False)  # zero between launches
        start = 0
        for linear in linears:
            cols = slice(start, start + linear.out_features)
            for name in ("qweight", "scales", "zeros"):
                setattr(linear, name, getattr(fused, name)[:, cols])
            if bias is not None:
                linear.bias = nn.Parameter(fused.bias[cols], requires_grad=False)
            start += linear.out_features
        return fused

    def unpacked(self) -> torch.Tensor:
        """q [K, N] (uint8) in the kernel's feature order (act-order: sorted by group)."""
        if self.qweight is None:
            from loraplex.quantization.w4a16 import tinygemm as w4a16_tinygemm

            return w4a16_tinygemm.unpack(self.int4pack, self.in_features, self.out_features)
        return unpack_int4(self.qweight, self.pack_block)

    def kernel_order_weight(self) -> torch.Tensor:
        """The weight [N, K] (float32, exact) with its input features in the kernel's order."""
        q = self.unpacked().to(torch.float32)
        zeros = self.zeros.to(torch.float32).repeat_interleave(self.group_size, 0)
        scales = self.scales.to(torch.float32).repeat_interleave(self.group_size, 0)
        return ((q - zeros) * scales).t()

    def dequantized(self) -> torch.Tensor:
        weight = self.kernel_order_weight()
        if self.perm is None:
            return weight
        original = torch.empty_like(weight)
        original[:, self.perm] = weight
        return original

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self.kernel == "triton":  # reads x through the permutation itself
            from loraplex.quantization.w4a16 import kernels as w4a16_triton

            return w4a16_triton.matmul(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias,
                                       self.split_counters, self.perm).reshape(*lead, self.out_features)
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        if self.kernel == "tinygemm":
            from loraplex.quantization.w4a16 import tinygemm as w4a16_tinygemm

            out = w4a16_tinygemm.matmul(x, self.int4pack, self.scale_and_zeros, self.group_size, self.bias)
        else:
            out = F.linear(x, self.kernel_order_weight().to(x.dtype), self.bias)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        act_order = ", act-order" if self.perm is not None else ""
        return f"{super().extra_repr()}, groups of {self.group_size}{act_order}, kernel={self.kernel}"


def _kernel_for(layer: W4A16Linear, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel that runs `layer`: KERNEL on CUDA where it takes the layer's shape and dtype, else the reference."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "reference"
    fits = layer.in_features % KERNEL_BLOCK == 0 and layer.group_size in KERNEL_GROUPS
    if KERNEL == "tinygemm" and fits and dtype == torch.bfloat16 and layer.out_features % 8 == 0:
        return "tinygemm"
    if KERNEL in ("triton", "tinygemm") and fits and triton_available(device):
        return "triton"
    return "reference"


def quantize_groups(weight: torch.Tensor, group_size: int, symmetric: bool):
    """Round-to-nearest 4-bit quantization of weight [N, K] in groups of `group_size` input features (for tests and
    benchmarks: checkpoints come quantized). Returns q [K, N] (0..15), zeros and scales [K / group_size, N]
    (symmetric: zero 8)."""
    n, k = weight.shape
    w = weight.to(torch.float32).reshape(n, k // group_size, group_size)
    if symmetric:
        scales = w.abs().amax(-1).clamp(min=1e-8) / 7.5
        zeros = torch.full_like(scales, 8.0)
    else:
        low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = ((high - low) / 15).clamp(min=1e-8)
        zeros = (-low / scales).round().clamp(0, 15)
    scales = scales.to(torch.float16).to(torch.float32)  # checkpoints store fp16 scales
    q = (w / scales[..., None] + zeros[..., None]).round().clamp(0, 15)
    return q.reshape(n, k).t().to(torch.uint8), zeros.t().contiguous(), scales.t().to(torch.float16).contiguous()


__all__ = ["KERNEL", "W4A16Linear", "act_order_permutation", "pack_int4", "quantize_groups", "unpack_int4"]
