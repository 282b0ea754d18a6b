"""The inputs of a graphed decode step, staged on the host and copied into the graph's static tensors; and its greedy
picks, copied back to the host without waiting (HostPicks).

Each step rewrites a few numbers per row (token, position, cache slot, length, adapter slot) and the rows' block
tables. Built as fresh tensors from Python lists, with a blocking copy each, they would cost host time the GPU
waits for. Here they are written into pinned host buffers that keep their contents from step to step (a row's
block table only where it changed: a running request's table only grows) and copied to the device asynchronously.
"""

from __future__ import annotations

from itertools import chain
from typing import Sequence

import torch


class StagedInputs:
    """Host copies of `static` [inputs, rows] and `tables` [rows, columns] (device tensors a graph reads)."""

    def __init__(self, static: torch.Tensor, tables: torch.Tensor) -> None:
        self.static, self.tables = static, tables
        pinned = static.device.type == "cuda"
        self._host_static = torch.zeros(static.shape, dtype=static.dtype, pin_memory=pinned)
        self._host_tables = torch.zeros(tables.shape, dtype=tables.dtype, pin_memory=pinned)
        self._static_view, self._tables_view = self._host_static.numpy(), self._host_tables.numpy()
        self._written: list[list[int]] = [[] for _ in range(tables.shape[0])]  # each row's table as last copied
        self._copied: torch.cuda.Event | None = None

    def write(self, columns: Sequence[Sequence[int]], tables: Sequence[Sequence[int]], bucket: int,
              pad_column: Sequence[int], pad_table: Sequence[int]) -> None:
        """columns[k][i]: input k of row i, tables[i]: row i's blocks; rows len(tables) .. bucket - 1 are padding
        (input k = pad_column[k], blocks pad_table). Columns of a row's table past its own blocks keep whatever
        they held: a row reads only up to its length."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies out of the host buffers have finished
        rows = len(tables)
        for k, (column, pad) in enumerate(zip(columns, pad_column)):
            self._static_view[k, :rows] = column
            self._static_view[k, rows:bucket] = pad
        for i, table in enumerate(chain(tables, [pad_table] * (bucket - rows))):
            self._write_row(i, table)
        self.static.copy_(self._host_static, non_blocking=True)
        self.tables[:bucket].copy_(self._host_tables[:bucket], non_blocking=True)
        if self.static.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _write_row(self, i: int, table: Sequence[int]) -> None:
        written = self._written[i]
        n = len(written)
        if len(table) >= n and table[:n] == written:  # the same blocks, maybe more: write only the new ones
            if len(table) > n:
                self._tables_view[i, n : len(table)] = table[n:]
                written.extend(table[n:])
        else:
            self._tables_view[i, : len(table)] = table
            self._written[i] = list(table)


class HostPicks:
    """Pinned host copies of launched steps' greedy picks ([3, rows] float64, logits.greedy_picks), copied from
    the device asynchronously. Two buffers in turn: one step's picks are read while the next step's are copied."""

    def __init__(self, max_rows: int) -> None:
        self._buffers = [torch.zeros(3 * max_rows, dtype=torch.float64, pin_memory=True) for _ in range(2)]
        self._next = 0

    def copy(self, picks: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Start copying `picks` [3, rows]; returns the host tensor and the event after which it holds them."""
        picks = picks.contiguous()  # a copy is asynchronous between contiguous tensors only
        host = self._buffers[self._next][: picks.numel()].view(picks.shape)
        self._next = 1 - self._next
        host.copy_(picks, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready
