"""The W4A16 product through PyTorch core's tinygemm (`aten._weight_int4pack_mm`, CUDA, bfloat16, groups of 32 to
256), a candidate the benchmark (benchmarks/w4a16_kernels.py) measures against our Triton kernel.

tinygemm dequantizes w = (q - 8) * scale + zero with a float zero, both bfloat16, so an integer zero point z
becomes zero = (8 - z) * scale, rounded: exact for symmetric checkpoints (z = 8), otherwise off by at most half a
bfloat16 ulp of |zero| (<= 8 * scale * 2^-9, a sixty-fourth of a quantization step) from the checkpoint's weight;
fp16 scales (GPTQ, AWQ) are rounded to bfloat16 too (2^-9 relative).

Its packed weight is opaque; `unpack` reads q back through the kernel itself (scale 1 and zero 8 give q exactly).
"""

from __future__ import annotations

import torch

INNER_K_TILES = 8  # needs K % 128 == 0, as the Triton kernel does


def pack(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [K, N] (0..15), zeros and scales [G, N] -> (tinygemm's packed weight, its scale-and-zero [G, N, 2])."""
    w = q.t().to(torch.uint8)  # [N, K]: two features a byte, the even one in the high nibble
    packed = torch.ops.aten._convert_weight_to_int4pack((w[:, ::2] << 4 | w[:, 1::2]).contiguous(), INNER_K_TILES)
    scales = scales.to(torch.float32)
    offset = (8 - zeros.to(torch.float32)) * scales
    scale_and_zeros = torch.stack([scales, offset], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scale_and_zeros


def matmul(x: torch.Tensor, packed: torch.Tensor, scale_and_zeros: torch.Tensor, group_size: int,
           bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bfloat16 @ the dequantized weight.T + bias -> [M, N]."""
    out = torch.ops.aten._weight_int4pack_mm(x.contiguous(), packed, group_size, scale_and_zeros)
    return out if bias is None else out + bias


def unpack(packed: torch.Tensor, in_features: int, out_features: int, chunk: int = 1024) -> torch.Tensor:
    """q [K, N] (uint8) from tinygemm's packed weight: the identity's rows through the kernel, `chunk` at a time."""
    groups = in_features // 128
    ones = torch.ones(groups, out_features, device=packed.device, dtype=torch.float32)
    identity_scales = torch.stack([ones, ones * 8], dim=-1).to(torch.bfloat16)
    rows = []
    for start in range(0, in_features, chunk):
        stop = min(start + chunk, in_features)
        eye = torch.zeros(stop - start, in_features, device=packed.device, dtype=torch.bfloat16)
        eye[:, start:stop] = torch.eye(stop - start, device=packed.device, dtype=torch.bfloat16)
        rows.append(torch.ops.aten._weight_int4pack_mm(eye, packed, 128, identity_scales))
    return torch.cat(rows).round().to(torch.uint8)
