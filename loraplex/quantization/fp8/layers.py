"""The FP8 (e4m3) linears of `--quantize fp8` (fp8.py) and of FP8 checkpoints (fp8/formats.py).

`Fp8Linear`: e4m3 weight [N, K] with per-output-channel float32 scales (a per-tensor checkpoint's one scale is
expanded to every channel at load) and per-token activation scales (dynamic), or the checkpoint's static per-tensor
`input_scale`. On an FP8 GPU (Ada, Hopper: compute capability 8.9+) the activations are quantized in one Triton
launch and multiplied on the tensor cores (`torch._scaled_mm`); elsewhere the same numerics are emulated in float32
(fp8/numerics.py), which is the reference the GPU path is tested against.

`Fp8BlockLinear`: DeepSeek-style block scales (`weight_scale_inv` per [128, 128] block). Its product is exact
against the dequantized weight: the weight is dequantized to the compute dtype on each forward (no FP8 tensor-core
path for it yet: it reads the e4m3 weight and writes a float one each call, slower than the float model).

The LoRA layer around either reads the layer's input x, never the FP8-quantized activations.
"""

from __future__ import annotations

import torch
from torch import nn

from loraplex.kernels import triton_available
import loraplex.quantization.fp8.numerics as numerics
from loraplex.quantization.layer import QuantizedLinear, common_key, frozen, fuse_by_channel


SCALED_MM_MIN_ROWS = 1  # see Fp8Linear.min_rows
WEIGHT_ONLY_DECODE = True  # see Fp8Linear.weight_only_decode
WEIGHT_ONLY_MAX_ROWS = 16  # products of more rows take _scaled_mm (weight_only's docstring says why)


class Fp8Linear(QuantizedLinear):
    """weight float8_e4m3fn [N, K], weight_scale float32 [N], optional static input_scale (float32 scalar)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias=False)
        if weight.dtype != numerics.FP8:
            raise ValueError(f"an FP8 weight must be float8_e4m3fn, not {weight.dtype}")
        scale = weight_scale.to(device=weight.device, dtype=torch.float32).reshape(-1)
        if scale.numel() == 1:  # per-tensor: the same scale on every channel
            scale = scale.expand(out_features)
        if scale.numel() != out_features:
            raise ValueError(f"weight_scale has {scale.numel()} values for {out_features} output channels")
        self.weight = frozen(weight.contiguous())
        self.weight_scale = frozen(scale.contiguous())
        self.bias = None if bias is None else frozen(bias)
        if input_scale is not None:
            input_scale = input_scale.to(device=weight.device, dtype=torch.float32).reshape(())
        self.input_scale = None if input_scale is None else frozen(input_scale)
        # "triton" (one launch) where it runs, else "torch" (four ops); benchmarks/fp8_kernels.py sets it to compare.
        self.activation_quant = "triton" if triton_available(weight.device) else "torch"
        # Products of fewer rows are padded to this many (zero rows) for `_scaled_mm`, with the Triton quantizer:
        # cuBLASLt's FP8 kernels for a few rows may be slower than for more; benchmarks/fp8_kernels.py measures.
        self.min_rows = SCALED_MM_MIN_ROWS
        # Few rows (decode) on CUDA: the weight-only product (weight_only: x unquantized); False: always _scaled_mm.
        self.weight_only_decode = WEIGHT_ONLY_DECODE

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]

    def quantize_input(self, rows: torch.Tensor, min_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Activation rows [M, K] -> (e4m3 rows, float32 scales [M, 1]), as the layer's product reads them; the
        Triton quantizer pads them with zero rows to `min_rows`."""
        if self.activation_quant == "triton" and rows.is_cuda and rows.stride(-1) == 1:
            from loraplex.quantization.fp8.kernels import quantize_rows

            return quantize_rows(rows, self.input_scale, min_rows)
        return numerics.quantize_rows_torch(rows, self.input_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            out = rows.new_empty(0, self.out_features)
        elif (self.weight_only_decode and rows.shape[0] <= WEIGHT_ONLY_MAX_ROWS and self.in_features % 128 == 0
              and triton_available(x.device)):
            import loraplex.quantization.weight_only as weight_only

            return weight_only.matmul(rows, self.weight, self.weight_scale, self.bias).view(*x.shape[:-1], self.out_features)
        else:
            if numerics.scaled_mm_usable(x.device, self.in_features, self.out_features):
                q, q_scale = self.quantize_input(rows, self.min_rows)
                out = numerics.scaled_mm(q, q_scale, self.weight, self.weight_scale.view(1, -1), x.dtype)
                out = out[: rows.shape[0]]
            else:
                q, q_scale = self.quantize_input(rows)
                out = numerics.emulated_scaled_mm(q, q_scale, self.weight, self.weight_scale, x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    @classmethod
    def fuse_siblings(cls, linears: list[nn.Module]) -> "Fp8Linear | None":
        """One Fp8Linear computing `linears` (siblings reading one input) in one product, their outputs
        concatenated in order; each sibling's tensors become views of the fused layer's (no second copy). None
        when they cannot fuse. Static input scales: the fused layer takes their max (every sibling's input is the
        same x, so the largest scale saturates none of them)."""
        first = linears[0]

        def build(stacked: list[torch.Tensor], bias: torch.Tensor | None) -> Fp8Linear:
            input_scale = None if first.input_scale is None else torch.stack([lin.input_scale for lin in linears]).amax()
            fused = cls(*stacked, bias, input_scale)
            fused.activation_quant, fused.min_rows = first.activation_quant, first.min_rows
            fused.weight_only_decode = first.weight_only_decode
            return fused

        return fuse_by_channel(cls, linears, ("weight", "weight_scale"),
                               lambda lin: (common_key(lin), lin.input_scale is None), build)


class Fp8BlockLinear(QuantizedLinear):
    """weight float8_e4m3fn [N, K], weight_scale_inv float32 [ceil(N / block_n), ceil(K / block_k)]: weight block
    (i, j) is multiplied by scale (i, j) (transformers names it "inverse": it is what the e4m3 values are
    multiplied by)."""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None = None) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias=False)
        if weight.dtype != numerics.FP8:
            raise ValueError(f"an FP8 weight must be float8_e4m3fn, not {weight.dtype}")
        self.block = tuple(block)
        want = (-(-out_features // block[0]), -(-in_features // block[1]))
        if tuple(weight_scale_inv.shape) != want:
            raise ValueError(f"weight_scale_inv is {tuple(weight_scale_inv.shape)}, blocks of {block} need {want}")
        self.weight = frozen(weight.contiguous())
        self.weight_scale_inv = frozen(weight_scale_inv.to(device=weight.device, dtype=torch.float32).contiguous())
        self.bias = None if bias is None else frozen(bias)

    def dequantized(self) -> torch.Tensor:
        block_n, block_k = self.block
        scale = self.weight_scale_inv.repeat_interleave(block_n, 0).repeat_interleave(block_k, 1)
        return self.weight.float() * scale[: self.out_features, : self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantized().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block={self.block}"
