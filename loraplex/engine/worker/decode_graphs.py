"""CUDA graphs for decode steps: the model's forward pass and its logits, captured once per batch-size bucket and
replayed, so a decode step costs one graph launch instead of a Python pass over every layer.

A step qualifies when every request computes exactly one token and samples it (no prefill rows, no drafts), the
model reads no cross-attention states, and it fits the largest bucket. Its rows are padded to the bucket: a
padding row reads token 0 at position 0, writes its key and value into a scratch block no request owns, and
attends to that block only; its logits are never read. Every kernel the graph holds reads its shapes from the
bucket and its data from static tensors (token ids, positions, cache slots, block tables, sequence lengths, each
row's adapter slot), refilled before each replay:

- norms, rotary embeddings and gated activations take their fused Triton kernels (layers/kernels/elementwise.py);
- attention is the Triton paged decode kernel, over block tables as wide as the longest sequence allowed (rows
  read their own length's blocks only);
- LoRA is the per-row form (lora/step/kernels/rows.py), which finds each slot's weights through tables: installing an
  adapter in a slot changes what a graph computes without a new capture, whatever its rank (up to the engine's
  largest). A graph covers the layers some installed adapter targets when it is captured: adapters that target
  other layers make a graph of their own (most deployments' adapters target the same modules). Steps without
  adapters replay graphs with no LoRA at all.

A row's input token is read through an index into a flat view of the static inputs: its own token id, staged from
the host, or the token the previous replay picked for one of its rows (each replay keeps its greedy picks on the
device). So a step can be launched before the host has read the last step's tokens (the engine's overlapped steps,
engine/worker/overlap.py).

Graphs are captured lazily, at a bucket's first step, sharing one memory pool. A capture that fails (something in
the model reads the device from the host) is undone, so that it leaves neither the stream capturing nor the
allocator recording into the pool; that bucket's steps then run eagerly (`can_replay`), logged once, and other
buckets are still captured, into a fresh pool.
"""

from __future__ import annotations

import bisect
import logging
from typing import Sequence

import torch
from torch import nn

from loraplex.engine.worker.graph_inputs import StagedInputs
from loraplex.engine.sampling.logits import greedy_picks
from loraplex.layers.forward_context import AttentionMetadata, DecodeGroup, ForwardContext, forward_context
from loraplex.lora.step.plan import LoraPlanner
from loraplex.models.base import ModelInputs

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
# Rows of the static input table: the first five are staged from the host each step; _PICKED holds the last
# replay's greedy tokens (written by the graph). A row's input token is flat[_INDEX row][i]: its own staged id
# (_IDS * width + i) or a picked token (_PICKED * width + row of the last replay).
_IDS, _POSITIONS, _SLOTS, _LENS, _ADAPTERS, _INDEX, _PICKED = range(7)
_STAGED = _INDEX + 1
log = logging.getLogger(__name__)


class CaptureFailed(RuntimeError):
    """A decode graph could not be captured: the step runs eagerly (and so will that bucket's later steps)."""


def graphable_family(inputs: ModelInputs) -> bool:
    """Whether a family's decode steps can be graphed: not when its cross-attention reads per-request states
    (an encoder's output, image states), which the graph's static inputs do not hold."""
    return not (inputs & (ModelInputs.ENCODER | ModelInputs.IMAGE_STATES))


class DecodeGraphs:
    def __init__(
        self, model: nn.Module, backend, kv_caches: list, planner: LoraPlanner, max_batch: int, max_seq_len: int,
        block_size: int, scratch_block: int, device: torch.device,
    ) -> None:
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.planner, self.lora = planner, planner.table  # the graphs' LoRA plans; the table, None without adapters
        self.sizes = [b for b in BATCH_SIZES if b < max_batch] + [min(max_batch, BATCH_SIZES[-1])]
        self.block_size, self.scratch_block = block_size, scratch_block
        self.width = -(-max_seq_len // block_size)  # block table columns: the longest sequence's blocks
        largest = self.sizes[-1]
        # The static inputs: row k of `_static` is input k for up to `largest` rows, and the block tables; a
        # bucket's inputs are their first rows.
        self._static = torch.zeros(_PICKED + 1, largest, dtype=torch.long, device=device)
        self._tables = torch.zeros(largest, self.width, dtype=torch.long, device=device)
        # A padding row reads row 0's staged id: any token will do.
        self._pad_column = [0, 0, scratch_block * block_size, 1, -1, _IDS * largest]
        self._inputs = StagedInputs(self._static[:_STAGED], self._tables)
        self._arange = torch.arange(largest, device=device)
        self._pool = None
        # (bucket, LoRA layers) -> the graph, its logits and its greedy picks (logits.greedy_picks)
        self._graphs: dict[tuple[int, frozenset[str] | None], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._failed: set[tuple[int, frozenset[str] | None]] = set()  # keys whose capture failed: eager

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def can_replay(self, rows: int, adapter_slots: Sequence[int | None]) -> bool:
        """Whether a decode step of `rows` rows with these adapter slots replays (or captures) a graph: not when
        its bucket's capture failed before."""
        return rows <= self.max_batch and self._key(rows, adapter_slots) not in self._failed

    def _key(self, rows: int, adapter_slots: Sequence[int | None]) -> tuple[int, frozenset[str] | None]:
        bucket = self.sizes[bisect.bisect_left(self.sizes, rows)]
        with_adapters = self.lora is not None and any(s is not None and s >= 0 for s in adapter_slots)
        return bucket, self.lora.pointers.targeted if with_adapters else None

    def run(self, input_ids: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]],
            adapter_slots: Sequence[int | None], picked_rows: Sequence[int] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [rows, vocab] of one decode row per sequence (position p writes its key and value at block
        block_tables[i][p // block_size]), and their greedy picks [3, rows] (`logits.greedy_picks`: the
        argmax, its logprob, whether the row is finite); `adapter_slots`: each row's LoRA slot or None.
        `picked_rows[i]` >= 0: row i's input is the token the last replay picked for that row, not input_ids[i]."""
        rows = len(input_ids)
        key = bucket, layers = self._key(rows, adapter_slots)
        assert key not in self._failed, "a step whose bucket failed to capture runs eagerly (can_replay)"
        adapters = [-1 if s is None else s for s in adapter_slots]
        width = self._static.shape[1]
        index = [_IDS * width + i if picked_rows is None or picked_rows[i] < 0 else _PICKED * width + picked_rows[i]
                 for i in range(rows)]
        self._fill(bucket, input_ids, positions, block_tables, adapters, index)
        if key not in self._graphs:
            self._graphs[key] = self._capture_or_give_up(key)
        graph, logits, picks = self._graphs[key]
        graph.replay()
        return logits[:rows], picks[:, :rows]

    def captured(self, rows: int, with_adapters: bool) -> torch.cuda.CUDAGraph | None:
        """The graph a step of `rows` rows would replay, if captured (benchmarks/step_shares.py replays it alone)."""
        bucket = self.sizes[bisect.bisect_left(self.sizes, rows)]
        layers = self.lora.pointers.targeted if with_adapters and self.lora is not None else None
        found = self._graphs.get((bucket, layers))
        return found[0] if found else None

    def _fill(self, bucket: int, input_ids, positions, block_tables, adapters, index) -> None:
        bs = self.block_size
        slots = [table[p // bs] * bs + p % bs for table, p in zip(block_tables, positions)]
        columns = (input_ids, positions, slots, [p + 1 for p in positions], adapters, index)
        self._inputs.write(columns, block_tables, bucket, self._pad_column, [self.scratch_block])

    def _context(self, bucket: int, layers: frozenset[str] | None) -> ForwardContext:
        static, rows = self._static, self._arange[:bucket]
        group = DecodeGroup(rows, rows, static[_LENS, :bucket], self.width * self.block_size, in_order=True)
        md = AttentionMetadata(
            slot_mapping=static[_SLOTS, :bucket], block_tables=self._tables[:bucket],
            seq_lens=[], query_start_loc=list(range(bucket + 1)), decode_groups=[group], prefill_seqs=[],
        )  # seq_lens: the graph's lengths live on the device only (the decode group's)
        lora = self.planner.graph_plan(static[_ADAPTERS, :bucket], layers) if layers is not None else None
        return ForwardContext(md, self.kv_caches, self.backend, lora)

    def _forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        static = self._static
        input_ids = static.view(-1).index_select(0, static[_INDEX, :bucket])
        hidden = self.model(input_ids, static[_POSITIONS, :bucket])
        logits = self.model.compute_logits(hidden)
        picks = greedy_picks(logits)
        static[_PICKED, :bucket] = picks[0]  # the next step's rows may read them
        return logits, picks

    def _capture_or_give_up(self, key: tuple[int, frozenset[str] | None]):
        try:
            return self._capture(*key)
        except Exception as exc:  # noqa: BLE001 - whatever a layer does under capture; the step then runs eagerly
            if not self._failed:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                log.warning("a decode graph (batch %d) could not be captured; such steps run eagerly: %s", key[0], first)
            self._failed.add(key)
            raise CaptureFailed(f"batch {key[0]}") from exc

    def _capture(self, bucket: int, layers: frozenset[str] | None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        # The capture runs on the padding rows' inputs (scratch block only): the step's own inputs are written
        # again after it, and nothing of the capture's run lands in a request's blocks.
        # The last replay's picks too: a step launched before its tokens were read needs them.
        filled, tables = self._static[:, :bucket].clone(), self._tables[:bucket].clone()
        self._static[:_STAGED, :bucket] = torch.tensor(self._pad_column, device=self._static.device)[:, None]
        self._tables[:bucket] = self.scratch_block
        ctx = self._context(bucket, layers)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        ctx.graph_warm_up = True
        with torch.cuda.stream(side), forward_context(ctx):  # compiles the kernels, warms the allocator
            self._forward(bucket)
        ctx.graph_warm_up = False  # the capture itself is told by torch.cuda.is_current_stream_capturing()
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.graph(graph, pool=self._pool)
        try:
            with capture, forward_context(ctx):
                logits, picks = self._forward(bucket)
        except BaseException:
            self._undo_capture(graph, capture)
            raise
        finally:
            self._static[:, :bucket], self._tables[:bucket] = filled, tables
        return graph, logits, picks

    def _undo_capture(self, graph: torch.cuda.CUDAGraph, capture: torch.cuda.graph) -> None:
        """After a capture raised: end the stream's capture and the allocator's recording into the pool (a failed
        `capture_end` skips the latter, and every later capture would then fail), go back to the stream the step
        was on (a failed `capture_end` skips that too), and give later captures a pool of their own (the graphs
        captured so far keep theirs)."""
        if torch.cuda.is_current_stream_capturing():
            try:
                graph.capture_end()
            except RuntimeError:
                pass  # an invalidated capture ends with an error: ended all the same
        try:
            torch._C._cuda_endAllocateToPool(self._static.device.index, self._pool)
        except RuntimeError:
            pass  # not recording any more
        capture.stream_ctx.__exit__(None, None, None)  # idempotent: it sets the stream it found back
        torch.cuda.synchronize()
        self._pool = None
