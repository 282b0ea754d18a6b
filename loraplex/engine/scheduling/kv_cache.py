"""Block allocator for the paged KV cache. Pure Python: only block ids, never tensors.

The cache is `num_blocks` blocks of `block_size` token slots each; token `i` of a request lives in
slot `block_ids[i // block_size] * block_size + i % block_size`.

Prefix caching (see `prefix_cache`): a full block whose keys and values are computed can be registered
under the hash of everything that made them. Blocks are reference-counted, so requests with the same
prefix share them; a registered block nobody uses keeps its contents, evictable, until a block is needed
and no plain free one is left (least recently used first).
"""

from __future__ import annotations

from collections import OrderedDict


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: recently freed blocks are reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._users: dict[int, int] = {}  # block in use -> how many requests hold it
        self._fresh: list[int] = []  # handed out since the last take_fresh(): their contents are stale
        # Prefix caching: registered blocks by content hash and back, and those of them no request holds
        # (least recently released first).
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return len(self._users)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        return len(self._users) / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_free} free")
        ids = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:  # evict the least recently used cached block
                block, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block)]
            self._users[block] = 1
            ids.append(block)
        self._fresh.extend(ids)
        return ids

    def take_fresh(self) -> list[int]:
        """Blocks allocated since the last call: the runner zeroes them before the step runs, so no
        request ever reads what an earlier owner left (a diverged request's NaN included)."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def free(self, ids: list[int]) -> None:
        """Release a request's hold on `ids`. Pass them last block first: a cached block released later is
        evicted later, so a prefix outlives the tails that branch from it."""
        for block in ids:
            users = self._users.get(block)
            assert users, f"block {block} freed twice or never allocated"
            if users > 1:
                self._users[block] = users - 1
                continue
            del self._users[block]
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # ---- prefix caching ------------------------------------------------------------------------------

    def cached_blocks(self, hashes: list[bytes]) -> list[int]:
        """The blocks registered under the longest run of `hashes` from the first (nothing is taken)."""
        blocks = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of `blocks` no request holds: taking them lowers `num_free` by as much."""
        return sum(1 for b in blocks if b in self._evictable)

    def take_cached(self, blocks: list[int]) -> None:
        """Hold cached blocks (from `cached_blocks`) for one more request."""
        for block in blocks:
            assert block in self._hash_of, f"block {block} is not cached"
            if block in self._evictable:
                del self._evictable[block]
                self._users[block] = 1
            else:
                self._users[block] += 1

    def register(self, block: int, content_hash: bytes) -> None:
        """Offer a held block, now fully computed, for sharing. A block already registered, or content
        another block already holds (two requests computed the same prefix at once), is left as it is."""
        assert block in self._users, f"block {block} is not in use"
        if block in self._hash_of or content_hash in self._by_hash:
            return
        self._hash_of[block] = content_hash
        self._by_hash[content_hash] = block

    def unregister(self, block: int) -> None:
        """Withdraw a held block from sharing (its step failed: it holds no usable keys and values)."""
        assert block in self._users, f"block {block} is not in use"
        content_hash = self._hash_of.pop(block, None)
        if content_hash is not None:
            del self._by_hash[content_hash]
