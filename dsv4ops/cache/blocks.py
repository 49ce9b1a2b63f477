"""Block allocation (free lists and reference counts) and the count check the planner, rewind and
fork share."""

from __future__ import annotations

import operator


class CacheFullError(RuntimeError):
    """No free request slot or block for the step; nothing was changed."""


class BlockAllocator:
    """A free list of block ids (lowest first, so runs are reproducible) and each block's reference
    count: every block-table entry that lists a block holds one reference (a fork shares its
    parent's complete blocks); a block goes back to the free list when its last holder drops it.

    `shards` (context parallelism): `num_blocks` blocks on each of `shards` ranks; block id
    = local block x shards + rank, and a block is taken from the pool of the rank that owns it."""

    def __init__(self, num_blocks: int, shards: int = 1):
        self.shards = shards
        self._free = [list(range((num_blocks - 1) * shards + s, -1, -shards)) for s in range(shards)]
        self.refs = [0] * (num_blocks * shards)

    @property
    def free(self) -> list[int]:
        """The free block ids, highest first."""
        return self._free[0] if self.shards == 1 else sorted((b for f in self._free for b in f), reverse=True)

    def free_count(self, shard: int = 0) -> int:
        return len(self._free[shard])

    def take(self, n: int, shard: int = 0) -> list[int]:
        taken = [self._free[shard].pop() for _ in range(n)]
        for b in taken:
            self.refs[b] = 1
        return taken

    def share(self, blocks: list[int]):
        for b in blocks:
            self.refs[b] += 1

    def drop(self, blocks: list[int]):
        freed = set()
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free[b % self.shards].append(b)
                freed.add(b % self.shards)
        for shard in freed:
            self._free[shard].sort(reverse=True)


def checked_count(name: str, n, low: int) -> int:
    """n as an int >= low, else a TypeError / ValueError naming `name`."""
    if isinstance(n, bool):
        raise TypeError(f"{name}: expected an int, got bool {n}")
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(n).__name__} {n!r}") from None
    if n < low:
        raise ValueError(f"{name}: expected >= {low}, got {n}")
    return n
