from __future__ import annotations

import pytest
import torch

from tandem.engine.block_manager import hash_block
from tandem.engine.kv_cache import KVCache, bytes_per_block
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence
from tests.engine.factories import make_kv, tiny_config

BS = 4


def make_seq(token_ids: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(token_ids), len(token_ids), SamplingParams())


def compute(kv: KVCache, seq: Sequence, n: int) -> None:
    """What a step does for ``n`` new tokens: blocks, the forward pass, then commit."""
    assert kv.ensure(seq, seq.num_computed + n)
    seq.num_computed += n
    kv.commit(seq)


def prefilled(kv: KVCache, token_ids: list[int], request_id: str = "r") -> Sequence:
    seq = make_seq(token_ids, request_id)
    kv.match_prefix(seq)
    compute(kv, seq, seq.num_uncomputed)
    return seq


def chain(token_ids: list[int], num_blocks: int) -> list[int]:
    """The chained hashes of the first ``num_blocks`` full blocks."""
    out: list[int] = []
    for i in range(num_blocks):
        out.append(hash_block(out[-1] if out else None, token_ids[i * BS : (i + 1) * BS]))
    return out


TOKENS = list(range(100, 112))  # three full blocks


# --- sizes ---


@pytest.mark.parametrize(
    ("block_size", "dtype", "expected"),
    [
        (4, torch.float32, 2 * 2 * 4 * 1 * 4 * 4),  # K+V x layers x tokens x kv heads x dim x 4 B
        (4, torch.bfloat16, 2 * 2 * 4 * 1 * 4 * 2),
        (16, torch.float16, 2 * 2 * 16 * 1 * 4 * 2),
    ],
)
def test_bytes_per_block(block_size: int, dtype: torch.dtype, expected: int) -> None:
    assert bytes_per_block(tiny_config(), block_size, dtype) == expected


def test_tensor_holds_the_pool_and_one_null_block() -> None:
    kv = make_kv(num_blocks=5)
    assert kv.tensor.shape == (2, 2, 6, BS, 1, 4)
    assert kv.tensor.dtype == torch.float32
    assert kv.tensor.nbytes == 6 * bytes_per_block(tiny_config(), BS, torch.float32) == 1536
    assert kv.pool.num_blocks == 5
    assert kv.null_block == 5


def test_blocks_are_zeroed_when_handed_out_and_the_null_block_is_never_used() -> None:
    # Attention reads the unwritten tail of a sequence's last block (masked): stale
    # NaN/inf from a previous owner there would poison the output, so it must be zero.
    kv = make_kv(num_blocks=5)
    kv.tensor.fill_(float("nan"))
    kv.tensor[:, :, kv.null_block] = 0
    seq = make_seq(list(range(3 * BS)))
    assert kv.ensure(seq, 3 * BS)
    assert kv.null_block not in seq.block_table
    assert torch.equal(kv.tensor[:, :, seq.block_table], torch.zeros_like(kv.tensor[:, :, :3]))
    kv.free(seq)


# --- ensure ---


@pytest.mark.parametrize(("tokens", "blocks"), [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_ensure_allocates_ceil_tokens_over_block_size(tokens: int, blocks: int) -> None:
    kv = make_kv()
    seq = make_seq(list(range(tokens)))
    assert kv.ensure(seq, tokens)
    assert seq.block_table == list(range(blocks))
    assert kv.pool.num_used == blocks


def test_ensure_grows_an_existing_table_only_when_needed() -> None:
    kv = make_kv()
    seq = make_seq(list(range(13)))
    assert kv.ensure(seq, 6)
    assert seq.block_table == [0, 1]
    assert kv.ensure(seq, 8)
    assert kv.ensure(seq, 3)
    assert seq.block_table == [0, 1]
    assert kv.ensure(seq, 13)
    assert seq.block_table == [0, 1, 2, 3]


def test_ensure_is_all_or_nothing() -> None:
    kv = make_kv(num_blocks=4)
    first = make_seq(list(range(8)), "a")
    assert kv.ensure(first, 8)
    second = make_seq(list(range(12)), "b")
    assert not kv.ensure(second, 12)  # needs 3, 2 are free
    assert second.block_table == []
    assert kv.pool.num_free == 2
    assert kv.ensure(second, 8)
    assert second.block_table == [2, 3]
    kv.pool.check_integrity()


@pytest.mark.parametrize("where", ["tensor", "ranks"])
def test_ensure_gives_the_blocks_back_when_zeroing_them_fails(where, monkeypatch) -> None:
    # The blocks were taken from the pool before they were zeroed (here, and with tensor
    # parallelism queued for the other ranks): a failure there left them in no block
    # table and off the free list, for good.
    kv = make_kv(num_blocks=6)
    holder = prefilled(kv, TOKENS, "cached")  # three cached blocks, then freed
    kv.free(holder)
    seq = make_seq(list(range(8)))
    assert kv.ensure(seq, 4) and seq.block_table == [3]
    before = (kv.pool.num_free, list(kv.pool._free), dict(kv.pool.hash_to_block))

    def fails(*args) -> None:
        raise RuntimeError("the zeroing failed")

    with monkeypatch.context() as patch:
        if where == "tensor":
            patch.setattr(torch.Tensor, "index_fill_", fails)
        else:
            patch.setattr(kv, "on_kv_op", fails)
        with pytest.raises(RuntimeError, match="the zeroing failed"):
            kv.ensure(seq, 8)
    # Back where they were: at the front of the free list, so that the next allocation
    # takes them rather than evicting cached blocks.
    assert (kv.pool.num_free, list(kv.pool._free), kv.pool.hash_to_block) == before
    assert seq.block_table == [3]
    kv.pool.check_integrity()
    assert kv.ensure(seq, 8) and kv.pool.num_free == before[0] - 1
    kv.free(seq)
    assert kv.pool.num_free == 6
    kv.pool.check_integrity()


# --- commit ---


def test_commit_hashes_only_full_computed_blocks_chained() -> None:
    kv = make_kv()
    seq = make_seq(TOKENS[:10])
    h0, h1 = chain(TOKENS, 2)

    compute(kv, seq, 3)
    assert kv.pool.hash_to_block == {}  # block 0 is not full yet
    compute(kv, seq, 3)  # 6 computed: block 0 full, block 1 half
    assert kv.pool.hash_to_block == {h0: 0}
    assert (seq.num_hashed_blocks, seq.last_block_hash) == (1, h0)
    compute(kv, seq, 4)  # 10 computed: blocks 0 and 1 full, block 2 partial
    assert kv.pool.hash_to_block == {h0: 0, h1: 1}
    assert kv.pool.block_hash[2] is None
    assert (seq.num_hashed_blocks, seq.last_block_hash) == (2, h1)
    # Chained: block 1's content alone, at the start of a prompt, is a different block.
    assert kv.pool.lookup(hash_block(None, TOKENS[4:8])) is None


def test_commit_ignores_allocated_but_uncomputed_blocks() -> None:
    kv = make_kv()
    seq = make_seq(TOKENS[:8])
    assert kv.ensure(seq, 8)
    seq.num_computed = 7
    kv.commit(seq)
    assert kv.pool.hash_to_block == {chain(TOKENS, 1)[0]: 0}


# --- match_prefix ---


def test_same_prompt_gets_the_same_blocks() -> None:
    kv = make_kv()
    first = prefilled(kv, TOKENS[:10], "a")
    assert first.block_table == [0, 1, 2]

    second = make_seq(TOKENS[:10], "b")
    kv.match_prefix(second)
    assert second.block_table == [0, 1]
    assert second.num_computed == 2 * BS
    assert (second.num_hashed_blocks, second.last_block_hash) == (2, chain(TOKENS, 2)[1])
    assert kv.pool.ref_counts[:3] == [2, 2, 1]
    compute(kv, second, second.num_uncomputed)
    assert second.block_table == [0, 1, 3]
    kv.pool.check_integrity()


@pytest.mark.parametrize(
    ("prompt_len", "matched"),
    [(4, 0), (5, 1), (8, 1), (9, 2), (12, 2)],
)
def test_match_leaves_at_least_one_token_to_compute(prompt_len: int, matched: int) -> None:
    kv = make_kv()
    prefilled(kv, TOKENS, "a")  # all three blocks cached
    seq = make_seq(TOKENS[:prompt_len], "b")
    kv.match_prefix(seq)
    assert seq.block_table == list(range(matched))
    assert seq.num_computed == matched * BS
    assert seq.num_uncomputed >= 1


def test_different_prompts_share_only_the_common_full_block_prefix() -> None:
    kv = make_kv()
    prefilled(kv, TOKENS, "a")  # blocks [0, 1, 2]
    diverges_in_block_1 = TOKENS[:6] + [0, 0] + TOKENS[8:] + [1]
    seq = make_seq(diverges_in_block_1, "b")
    kv.match_prefix(seq)
    assert seq.block_table == [0]
    assert seq.num_computed == BS

    # Same content as cached block 1, but after a different first block: no match.
    diverges_in_block_0 = [0] + TOKENS[1:] + [1]
    other = make_seq(diverges_in_block_0, "c")
    kv.match_prefix(other)
    assert other.block_table == []
    assert other.num_computed == 0


def test_freed_blocks_are_matched_from_the_free_list_until_evicted() -> None:
    kv = make_kv(num_blocks=8)
    first = prefilled(kv, TOKENS + [1], "a")  # blocks [0, 1, 2, 3]
    kv.free(first)  # tail first: free list is [4, 5, 6, 7, 3, 2, 1, 0]
    assert kv.pool.num_used == 0

    filler = make_seq(list(range(24)), "filler")
    assert kv.ensure(filler, 24)
    assert filler.block_table == [4, 5, 6, 7, 3, 2]  # evicts the tail of the prefix first

    seq = make_seq(TOKENS + [1], "b")
    kv.match_prefix(seq)
    assert seq.block_table == [0, 1]  # block 2 (the third block) was reused
    assert seq.num_computed == 2 * BS
    assert kv.pool.num_free == 0  # the hits left the free list
    kv.pool.check_integrity()


def test_match_prefix_does_nothing_for_a_sequence_that_holds_blocks() -> None:
    kv = make_kv()
    prefilled(kv, TOKENS, "a")
    seq = make_seq(TOKENS, "b")
    assert kv.ensure(seq, 1)
    kv.match_prefix(seq)
    assert seq.block_table == [3]
    assert seq.num_computed == 0


def test_prefix_caching_disabled_never_matches() -> None:
    kv = make_kv(prefix_caching=False)
    first = prefilled(kv, TOKENS, "a")
    assert kv.pool.hash_to_block == {}
    assert first.num_hashed_blocks == 0
    seq = make_seq(TOKENS, "b")
    kv.match_prefix(seq)
    assert seq.block_table == []
    assert seq.num_computed == 0


# --- free ---


def test_free_returns_every_block_and_resets_the_sequence() -> None:
    kv = make_kv()
    first = prefilled(kv, TOKENS[:10], "a")  # [0, 1, 2]
    second = prefilled(kv, TOKENS[:10], "b")  # [0, 1, 3]
    assert kv.pool.num_used == 4

    kv.free(second)
    assert (second.block_table, second.num_computed) == ([], 0)
    assert (second.num_hashed_blocks, second.last_block_hash) == (0, None)
    assert kv.pool.ref_counts[:4] == [1, 1, 1, 0]
    kv.pool.check_integrity()

    kv.free(first)
    assert kv.pool.num_used == 0
    assert kv.pool.num_free == 8
    kv.pool.check_integrity()
    # The cached prefix survives both frees.
    assert kv.pool.lookup(chain(TOKENS, 2)[1]) == 1
