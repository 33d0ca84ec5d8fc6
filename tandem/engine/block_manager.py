"""The KV block pool: free list, reference counts and prefix hashes.

Invariants (checked by ``check_integrity``):
- every block is either free (ref count 0, in the free list) or used (ref > 0);
  ``num_free + num_used == num_blocks``;
- a hash maps to at most one block and that block carries the same hash.

A freed block keeps its hash while it sits in the free list, so a later request
with the same prefix can take it back (prefix caching); the least recently freed
block is the first one reused, which evicts its hash.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from tandem.errors import OutOfBlocksError


def hash_block(parent: int | None, token_ids: Sequence[int]) -> int:
    """Content hash of a full block, chained on its predecessor's hash.

    blake2b rather than Python's hash(): stable across processes, so prefill and
    decode workers (and a prefix-aware router) agree on it.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little", signed=False))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def prefix_root(cache_salt: str) -> int | None:
    """The hash a sequence's block chain starts from (``hash_block``'s first parent):
    sequences with different salts never share a cached block, and ``""`` is the
    unsalted chain."""
    if not cache_salt:
        return None
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "little")


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Insertion order = order of freeing; the front is reused first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # on_evict(block, hash): a cached block is about to be reused for other data
        # (a host tier copies it out first).
        self.on_evict: Callable[[int, int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` fresh blocks (ref count 1), all or nothing."""
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} free")
        out: list[int] = []
        try:
            for _ in range(n):
                block = next(iter(self._free))
                h = self.block_hash[block]
                if h is not None and self.on_evict is not None:
                    self.on_evict(block, h)  # may raise: the block is still free and cached
                del self._free[block]
                self._forget_hash(block)
                self.ref_counts[block] = 1
                out.append(block)
        except BaseException:  # all or nothing: those taken go back, unhashed
            self.give_back(out)
            raise
        return out

    def give_back(self, blocks: Sequence[int]) -> None:
        """Undo the ``allocate`` that returned ``blocks``, before anything used them: free
        again, at the front of the free list where they were, so that the next
        allocation takes them rather than evicting another cached block."""
        for block in reversed(blocks):
            self.ref_counts[block] = 0
            self._free[block] = None
            self._free.move_to_end(block, last=False)

    def share(self, block: int) -> None:
        """Take another reference to a block (a prefix-cache hit or a fork)."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go back to the free list."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"double free of KV block {block}")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def lookup(self, block_hash: int) -> int | None:
        return self.hash_to_block.get(block_hash)

    def set_hash(self, block: int, block_hash: int) -> None:
        """Record the content hash of a full, computed block.

        If another block already holds identical content, the first one stays the
        cached copy and this block stays unhashed (it is freed like any other).
        """
        if block_hash in self.hash_to_block or self.block_hash[block] is not None:
            return
        self.block_hash[block] = block_hash
        self.hash_to_block[block_hash] = block

    def _forget_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self.hash_to_block[h]
            self.block_hash[block] = None

    def check_integrity(self) -> None:
        """Raise AssertionError if any pool invariant is broken."""
        used = sum(1 for r in self.ref_counts if r > 0)
        assert len(self._free) + used == self.num_blocks, (
            f"free {len(self._free)} + used {used} != total {self.num_blocks}"
        )
        for block in self._free:
            assert self.ref_counts[block] == 0, f"free block {block} has refs"
        assert all(r >= 0 for r in self.ref_counts), "negative ref count"
        for h, block in self.hash_to_block.items():
            assert self.block_hash[block] == h, f"hash map disagrees for block {block}"
        hashed = sum(1 for h in self.block_hash if h is not None)
        assert hashed == len(self.hash_to_block), "a hashed block is missing from the map"
