from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.engine.block_manager import BlockPool, hash_block
from tandem.errors import OutOfBlocksError


def make_pool(num_blocks: int = 4, block_size: int = 4) -> BlockPool:
    pool = BlockPool(num_blocks, block_size)
    pool.check_integrity()
    return pool


def full_pool(num_blocks: int = 4) -> BlockPool:
    """A pool with every block allocated, in id order, so tests choose the free order."""
    pool = make_pool(num_blocks)
    assert pool.allocate(num_blocks) == list(range(num_blocks))
    return pool


# --- hash_block ---


def test_an_allocation_whose_eviction_fails_leaves_the_free_list_as_it_was() -> None:
    # The blocks it had taken went back at the end, unhashed, so the next allocation
    # evicted another cached block while they sat unused.
    pool = BlockPool(3, 4)
    blocks = pool.allocate(3)
    for block, block_hash in zip(blocks, (100, 101, 102), strict=True):
        pool.set_hash(block, block_hash)
    pool.free(blocks)
    before = list(pool._free)

    def evict(block: int, block_hash: int) -> None:
        if block_hash == 101:
            raise RuntimeError("injected: the copy to the host tier failed")

    pool.on_evict = evict
    with pytest.raises(RuntimeError, match="injected"):
        pool.allocate(2)
    assert list(pool._free) == before and pool.num_used == 0
    assert pool.lookup(101) == blocks[1] and pool.lookup(100) is None  # 100 was evicted
    pool.check_integrity()


def test_hash_block_is_pinned_so_processes_and_the_router_agree() -> None:
    # blake2b, not hash(): these values must not change between runs or versions.
    first = hash_block(None, [1, 2, 3, 4])
    assert first == 2821693476514209883
    assert hash_block(first, [5, 6, 7, 8]) == 4335464902204770104


def test_hash_block_is_chained_on_the_parent() -> None:
    tokens = [5, 6, 7, 8]
    assert hash_block(None, tokens) == hash_block(None, list(tokens))
    assert hash_block(None, tokens) != hash_block(hash_block(None, [1, 2, 3, 4]), tokens)
    assert hash_block(None, tokens) != hash_block(None, [5, 6, 7, 9])
    assert hash_block(None, tokens) != hash_block(None, [8, 7, 6, 5])


# --- allocate / free / share ---


def test_num_blocks_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        BlockPool(0, 4)


def test_fresh_pool_allocates_in_id_order() -> None:
    pool = make_pool(5)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(0) == []
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.ref_counts == [1, 1, 1, 1, 1]
    assert (pool.num_free, pool.num_used) == (0, 5)
    pool.check_integrity()


def test_least_recently_freed_block_is_reused_first() -> None:
    pool = full_pool(4)
    pool.free([2])
    pool.free([0, 3])  # within one call, in list order
    assert pool.num_free == 3
    assert pool.allocate(1) == [2]
    assert pool.allocate(2) == [0, 3]
    pool.free([1])
    assert pool.allocate(1) == [1]
    pool.check_integrity()


def test_reuse_evicts_the_hash_of_the_least_recently_freed_block_only() -> None:
    pool = full_pool(4)
    pool.set_hash(0, 100)
    pool.set_hash(2, 102)
    pool.free([2])
    pool.free([0])
    assert pool.allocate(1) == [2]
    assert pool.lookup(102) is None
    assert pool.block_hash[2] is None
    assert pool.lookup(100) == 0  # still cached in the free list
    assert pool.allocate(1) == [0]
    assert pool.lookup(100) is None
    assert pool.hash_to_block == {}
    pool.check_integrity()


def test_shared_block_is_freed_only_by_its_last_reference() -> None:
    pool = make_pool(4)
    assert pool.allocate(1) == [0]
    pool.share(0)
    assert pool.ref_counts[0] == 2
    pool.free([0])
    assert pool.ref_counts[0] == 1
    assert pool.num_free == 3
    pool.free([0])
    assert pool.ref_counts[0] == 0
    assert pool.num_free == 4
    pool.check_integrity()


def test_double_free_raises_and_names_the_block() -> None:
    pool = make_pool(4)
    assert pool.allocate(2) == [0, 1]
    pool.free([1])
    with pytest.raises(RuntimeError, match="double free of KV block 1"):
        pool.free([1])
    with pytest.raises(RuntimeError, match="double free of KV block 3"):
        pool.free([3])  # never allocated
    assert pool.ref_counts == [1, 0, 0, 0]
    pool.check_integrity()


def test_out_of_blocks_is_all_or_nothing() -> None:
    pool = full_pool(4)
    pool.set_hash(3, 103)
    pool.free([3])
    pool.free([1])  # free list: [3, 1]
    with pytest.raises(OutOfBlocksError, match="need 3 KV blocks, 2 free"):
        pool.allocate(3)
    # Nothing was taken and no hash was evicted by the failed call.
    assert pool.ref_counts == [1, 0, 1, 0]
    assert pool.num_free == 2
    assert pool.lookup(103) == 3
    pool.check_integrity()
    assert pool.allocate(2) == [3, 1]


# --- prefix hashes ---


def test_set_hash_and_lookup() -> None:
    pool = make_pool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.lookup(7) is None
    pool.set_hash(1, 7)
    assert pool.lookup(7) == 1
    assert pool.block_hash == [None, 7, None, None]
    pool.check_integrity()


def test_duplicate_content_keeps_the_first_block() -> None:
    pool = make_pool(4)
    assert pool.allocate(2) == [0, 1]
    pool.set_hash(0, 7)
    pool.set_hash(1, 7)
    assert pool.lookup(7) == 0
    assert pool.block_hash == [7, None, None, None]
    # The duplicate is freed like any other block; the cached copy is untouched.
    pool.free([1])
    assert pool.allocate(3) == [2, 3, 1]
    assert pool.lookup(7) == 0
    pool.check_integrity()


def test_set_hash_does_not_rehash_a_hashed_block() -> None:
    pool = make_pool(4)
    assert pool.allocate(1) == [0]
    pool.set_hash(0, 7)
    pool.set_hash(0, 8)
    assert pool.lookup(7) == 0
    assert pool.lookup(8) is None
    pool.check_integrity()


def test_freed_hashed_block_is_taken_back_by_share() -> None:
    pool = make_pool(4)
    assert pool.allocate(2) == [0, 1]
    pool.set_hash(1, 11)
    pool.free([1, 0])  # free list: [2, 3, 1, 0]
    assert pool.lookup(11) == 1
    assert pool.num_free == 4

    pool.share(1)  # a prefix-cache hit
    assert pool.ref_counts[1] == 1
    assert pool.num_free == 3
    pool.check_integrity()
    # Block 1 left the free list: fresh allocations never hand it out.
    assert pool.allocate(3) == [2, 3, 0]
    assert pool.num_free == 0
    assert pool.lookup(11) == 1

    pool.free([1])
    assert pool.lookup(11) == 1  # still cached after its last reference goes
    assert pool.allocate(1) == [1]
    assert pool.lookup(11) is None
    pool.check_integrity()


# --- check_integrity ---


def _zero_a_used_ref(pool: BlockPool) -> None:
    pool.ref_counts[0] = 0


def _ref_on_a_free_block(pool: BlockPool) -> None:
    # Counts still add up (one used block less, one more), so only the free-list check sees it.
    pool.ref_counts[0] = 0
    pool.ref_counts[3] = 1


def _negative_ref(pool: BlockPool) -> None:
    pool.ref_counts[1] = -1


def _hash_map_points_elsewhere(pool: BlockPool) -> None:
    pool.hash_to_block[10] = 1


def _hashed_block_missing_from_map(pool: BlockPool) -> None:
    pool.block_hash[2] = 12


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_zero_a_used_ref, r"free 2 \+ used 1 != total 4"),
        (_ref_on_a_free_block, "free block 3 has refs"),
        (_negative_ref, r"free 2 \+ used 1 != total 4"),
        (_hash_map_points_elsewhere, "hash map disagrees for block 1"),
        (_hashed_block_missing_from_map, "a hashed block is missing from the map"),
    ],
)
def test_check_integrity_catches_corruption(
    corrupt: Callable[[BlockPool], None], message: str
) -> None:
    pool = make_pool(4)
    assert pool.allocate(2) == [0, 1]
    pool.set_hash(0, 10)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


# --- random operation sequences against a model ---

NUM_BLOCKS = 6
HASHES = st.integers(0, 4)  # few values, so duplicate content is common


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / free / share / set_hash against a plain model of the pool.

    The model keeps the free list in order, so every allocate checks exact ids
    (least recently freed first) and every eviction.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, block_size=4)
        self.refs = [0] * NUM_BLOCKS
        self.free_order = list(range(NUM_BLOCKS))
        self.hash_of: dict[int, int] = {}  # block -> hash

    def _references(self) -> list[int]:
        """One entry per live reference, e.g. [0, 0, 3] for block 0 shared twice."""
        return [b for b, r in enumerate(self.refs) for _ in range(r)]

    @rule(n=st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, n: int) -> None:
        if n > len(self.free_order):
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate(n)
            return
        expected, self.free_order = self.free_order[:n], self.free_order[n:]
        assert self.pool.allocate(n) == expected
        for b in expected:
            self.refs[b] = 1
            self.hash_of.pop(b, None)

    @precondition(lambda self: any(self.refs))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        refs = self._references()
        picks = data.draw(
            st.lists(st.integers(0, len(refs) - 1), min_size=1, max_size=len(refs), unique=True)
        )
        blocks = [refs[i] for i in picks]
        self.pool.free(blocks)
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_order.append(b)

    @rule(block=st.integers(0, NUM_BLOCKS - 1))
    def double_free(self, block: int) -> None:
        if self.refs[block]:
            return
        with pytest.raises(RuntimeError, match=f"double free of KV block {block}"):
            self.pool.free([block])

    @rule(block=st.integers(0, NUM_BLOCKS - 1))
    def share(self, block: int) -> None:
        # A fork of a used block, or a prefix hit on a cached free one.
        if not self.refs[block] and block not in self.hash_of:
            return
        self.pool.share(block)
        if self.refs[block] == 0:
            self.free_order.remove(block)
        self.refs[block] += 1

    @rule(block=st.integers(0, NUM_BLOCKS - 1), block_hash=HASHES)
    def set_hash(self, block: int, block_hash: int) -> None:
        if not self.refs[block]:
            return  # only a block being computed gets hashed
        self.pool.set_hash(block, block_hash)
        if block not in self.hash_of and block_hash not in self.hash_of.values():
            self.hash_of[block] = block_hash

    @invariant()
    def matches_model(self) -> None:
        self.pool.check_integrity()
        pool = self.pool
        assert pool.num_free + pool.num_used == NUM_BLOCKS
        assert pool.num_free == len(self.free_order)
        assert pool.ref_counts == self.refs
        assert pool.block_hash == [self.hash_of.get(b) for b in range(NUM_BLOCKS)]
        for h in range(5):
            expected = next((b for b, bh in self.hash_of.items() if bh == h), None)
            assert pool.lookup(h) == expected


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
