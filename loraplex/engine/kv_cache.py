"""Block allocator for the paged KV cache. Pure Python: only block ids, never tensors.

The cache is `num_blocks` blocks of `block_size` token slots each; token `i` of a request lives in
slot `block_ids[i // block_size] * block_size + i % block_size`.
"""

from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: recently freed blocks are reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._in_use: set[int] = set()
        self._fresh: list[int] = []  # handed out since the last take_fresh(): their contents are stale

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._in_use)

    @property
    def usage(self) -> float:
        return len(self._in_use) / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        self._in_use.update(ids)
        self._fresh.extend(ids)
        return ids

    def take_fresh(self) -> list[int]:
        """Blocks allocated since the last call: the runner zeroes them before the step runs, so no
        request ever reads what an earlier owner left (a diverged request's NaN included)."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def free(self, ids: list[int]) -> None:
        for block in ids:
            assert block in self._in_use, f"block {block} freed twice or never allocated"
            self._in_use.remove(block)
            self._free.append(block)
