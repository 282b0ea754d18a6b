"""LoRA kernels: each adds every row's own adapter delta to a linear's output, and nothing else.

- `segments`: rows grouped by adapter into contiguous segments; one matmul pair per segment (prefill), or all
  segments stacked into two batched matmuls (short segments: decode on the CPU).
- `rows`: each row names its slot (-1: none) and the weights are found through per-slot pointer tables, so
  the call's shapes do not depend on which adapters a step uses (decode on CUDA, CUDA graphs). Its torch
  function is the reference; `bgmv` is the Triton kernel (imported only on CUDA).
- `tiles`: the per-row form for rows that come in runs of one adapter (eager steps: prompts, several requests'
  decode rows), cut into tiles that each read their adapter once; `sgmv` is its Triton kernel (CUDA only).

The isolation rule (docs/architecture.md) holds for all: a row's delta is computed from that row's input and
its own adapter's weights only, so a NaN or inf in one adapter never reaches another's rows.
"""

from loraplex.lora.step.kernels.rows import PointerTable, add_lora_rows_reference
from loraplex.lora.step.kernels.segments import add_lora, add_lora_stacked

__all__ = ["PointerTable", "add_lora", "add_lora_rows_reference", "add_lora_stacked"]
