"""The attention backends against a naive dense reference.

The reference and the cases are backend-generic: every backend in conftest.py's
``BACKEND_NAMES`` runs every case (triton on CPU through its interpreter, cpu where a C compiler is;
see conftest.py). Only
``gather_kv``, a helper of the torch reference itself, is tested outside that list.

Caches start filled with random values, not zeros, so that reading a wrong slot or
writing outside the given ones changes the result. The values past a sequence's end
are finite by contract (the KV cache zeroes blocks when it hands them out, see
tests/engine/test_kv_cache.py): masked scores are -inf, but NaN + -inf is still NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from tandem.kernels import torch_ref

# The backend fixture (conftest.py) runs each test on every backend; tiny tensors
# run on one torch thread.
pytestmark = pytest.mark.usefixtures("one_thread")

KV_HEADS = 2
HEAD_DIM = 32
NUM_BLOCKS = 12
# A fixed, deliberately unordered assignment of block ids to sequences: tables are not
# increasing, and block 0 is a real block of one sequence while also being the padding.
SHUFFLED_BLOCK_IDS = (7, 2, 11, 5, 0, 9, 3, 10, 1, 6, 4, 8)

# bf16 stores ~3 significant digits and the torch reference also rounds scores and
# probabilities to bf16: its largest error here is 8e-3. float16 has 3 more bits.
# float32 errors are ~1e-6.
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


@dataclass(frozen=True)
class Shape:
    block_size: int
    group: int  # query heads per KV head
    dtype: torch.dtype

    @property
    def num_heads(self) -> int:
        return KV_HEADS * self.group

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(HEAD_DIM)


@pytest.fixture(
    params=[
        Shape(block_size, group, dtype)
        for block_size in (4, 16)
        for group in (1, 3)
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    ],
    ids=lambda s: f"bs{s.block_size}-group{s.group}-{str(s.dtype).removeprefix('torch.')}",
)
def shape(request: pytest.FixtureRequest) -> Shape:
    return request.param


# --- reference and factories ---


def reference_attention(
    q: torch.Tensor,  # [query_len, num_heads, head_dim]
    k: torch.Tensor,  # [context_len, kv_heads, head_dim], dense
    v: torch.Tensor,
    positions: list[int],  # each query row's position; it sees keys 0..position
    scale: float,
) -> torch.Tensor:
    """Dense causal attention in float64, one head at a time: [query_len, num_heads, head_dim]."""
    num_heads = q.shape[1]
    group = num_heads // k.shape[1]
    context_len = k.shape[0]
    hidden = torch.arange(context_len)[None, :] > torch.tensor(positions)[:, None]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        kv_head = h // group
        scores = q[:, h].double() @ k[:, kv_head].double().T * scale  # [query_len, context_len]
        scores = scores.masked_fill(hidden, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, kv_head].double()
    return out


def _randn(*size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _random_cache(shape: Shape, seed: int) -> torch.Tensor:
    return _randn(NUM_BLOCKS, shape.block_size, KV_HEADS, HEAD_DIM, dtype=shape.dtype, seed=seed)


def _slot(block_table: list[int], position: int, block_size: int) -> int:
    return block_table[position // block_size] * block_size + position % block_size


def _write(cache: torch.Tensor, block_table: list[int], dense: torch.Tensor) -> None:
    """Put dense[p] at position p of the sequence, token by token (independent of store_kv)."""
    block_size = cache.shape[1]
    for p in range(dense.shape[0]):
        cache[block_table[p // block_size], p % block_size] = dense[p]


def _with_new_garbage(
    cache: torch.Tensor, block_table: list[int], context_len: int, seed: int
) -> torch.Tensor:
    """A copy of ``cache`` where every slot except the sequence's first context_len is new."""
    block_size = cache.shape[1]
    kept = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for p in range(context_len):
        kept[block_table[p // block_size], p % block_size] = True
    garbage = 100 * _randn(*cache.shape, dtype=torch.float32, seed=seed).to(cache.dtype)
    out = torch.where(kept[:, :, None, None], cache, garbage)
    assert (out != cache).any()  # the garbage really differs from what it replaces
    return out


def _assert_matches_reference(out: torch.Tensor, expected: torch.Tensor, shape: Shape) -> None:
    assert out.dtype == shape.dtype
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[shape.dtype])


# --- store_kv ---


def test_store_kv_writes_exactly_the_given_slots(backend: ModuleType, shape: Shape) -> None:
    bs = shape.block_size
    # Scattered over several blocks, not in order, including slot 0 and the last slot.
    slots = [5 * bs + 1, 0, NUM_BLOCKS * bs - 1, 2 * bs + bs - 1, 5 * bs, 9 * bs + 2]
    k = _randn(len(slots), KV_HEADS, HEAD_DIM, dtype=shape.dtype, seed=1)
    v = _randn(len(slots), KV_HEADS, HEAD_DIM, dtype=shape.dtype, seed=2)
    k_cache, v_cache = _random_cache(shape, seed=3), _random_cache(shape, seed=4)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots):
        expected_k[slot // bs, slot % bs] = k[i]
        expected_v[slot // bs, slot % bs] = v[i]

    backend.store_kv(k, v, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64))

    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


# --- prefill_attention ---

# (context_len, query_len) in units of block_size plus an offset, so each block size
# gets lengths that are and are not multiples of it.
PREFILL_CASES = {
    "no-prefix": lambda bs: (2 * bs + 3, 2 * bs + 3),
    "no-prefix-one-token": lambda bs: (1, 1),
    "prefix-chunk-across-a-block-boundary": lambda bs: (2 * bs + 3, 5),
    "prefix-of-whole-blocks": lambda bs: (3 * bs, bs),
    "prefix-one-new-token": lambda bs: (bs + 2, 1),
}


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_attention_matches_reference(backend: ModuleType, shape: Shape, case: str) -> None:
    context_len, query_len = PREFILL_CASES[case](shape.block_size)
    prefix = context_len - query_len
    block_table = list(SHUFFLED_BLOCK_IDS[: -(-context_len // shape.block_size)])
    k = _randn(context_len, KV_HEADS, HEAD_DIM, dtype=shape.dtype, seed=10)
    v = _randn(context_len, KV_HEADS, HEAD_DIM, dtype=shape.dtype, seed=11)
    q = _randn(query_len, shape.num_heads, HEAD_DIM, dtype=shape.dtype, seed=12)
    k_cache, v_cache = _random_cache(shape, seed=13), _random_cache(shape, seed=14)
    _write(k_cache, block_table, k)  # the prefix and the new tokens
    _write(v_cache, block_table, v)
    table = torch.tensor(block_table, dtype=torch.int64)

    out = backend.prefill_attention(q, k_cache, v_cache, table, context_len, shape.scale)

    assert out.shape == (query_len, shape.num_heads, HEAD_DIM)
    positions = list(range(prefix, context_len))
    _assert_matches_reference(out, reference_attention(q, k, v, positions, shape.scale), shape)

    k_garbage = _with_new_garbage(k_cache, block_table, context_len, seed=15)
    v_garbage = _with_new_garbage(v_cache, block_table, context_len, seed=16)
    again = backend.prefill_attention(q, k_garbage, v_garbage, table, context_len, shape.scale)
    assert torch.equal(again, out)


# --- decode_attention ---


@dataclass(frozen=True)
class DecodeBatch:
    q: torch.Tensor  # [batch, num_heads, head_dim]
    k: list[torch.Tensor]  # per sequence, [context_len, kv_heads, head_dim]
    v: list[torch.Tensor]
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: list[list[int]]  # unpadded
    padded_tables: torch.Tensor  # [batch, max_blocks], int64, padded with block 0
    context_lens: list[int]


def _decode_batch(shape: Shape) -> DecodeBatch:
    bs = shape.block_size
    # A single token, just short of a block boundary, exactly on one, just past one.
    context_lens = [1, 2 * bs - 1, 2 * bs, 3 * bs + 1]
    ids = iter(SHUFFLED_BLOCK_IDS)
    block_tables = [[next(ids) for _ in range(-(-n // bs))] for n in context_lens]
    assert block_tables == [[7], [2, 11], [5, 0], [9, 3, 10, 1]]  # out of order, 0 inside
    max_blocks = 5  # one more than the longest needs: every row has padding
    padded = [table + [0] * (max_blocks - len(table)) for table in block_tables]
    k_cache, v_cache = _random_cache(shape, seed=20), _random_cache(shape, seed=21)
    k, v = [], []
    for i, (table, n) in enumerate(zip(block_tables, context_lens, strict=True)):
        k.append(_randn(n, KV_HEADS, HEAD_DIM, dtype=shape.dtype, seed=100 + i))
        v.append(_randn(n, KV_HEADS, HEAD_DIM, dtype=shape.dtype, seed=200 + i))
        _write(k_cache, table, k[i])
        _write(v_cache, table, v[i])
    q = _randn(len(context_lens), shape.num_heads, HEAD_DIM, dtype=shape.dtype, seed=22)
    return DecodeBatch(
        q=q,
        k=k,
        v=v,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        padded_tables=torch.tensor(padded, dtype=torch.int64),
        context_lens=context_lens,
    )


def _decode(backend: ModuleType, batch: DecodeBatch, shape: Shape, k_cache=None, v_cache=None):
    return backend.decode_attention(
        batch.q,
        batch.k_cache if k_cache is None else k_cache,
        batch.v_cache if v_cache is None else v_cache,
        batch.padded_tables,
        torch.tensor(batch.context_lens, dtype=torch.int64),
        max(batch.context_lens),
        shape.scale,
    )


def test_decode_attention_matches_reference_per_sequence(backend: ModuleType, shape: Shape) -> None:
    batch = _decode_batch(shape)

    out = _decode(backend, batch, shape)

    assert out.shape == (len(batch.context_lens), shape.num_heads, HEAD_DIM)
    for i, n in enumerate(batch.context_lens):
        # The new token is the last of the context and sees all of it.
        expected = reference_attention(
            batch.q[i : i + 1], batch.k[i], batch.v[i], [n - 1], shape.scale
        )
        _assert_matches_reference(out[i : i + 1], expected, shape)


def test_decode_attention_of_a_lone_sequence_matches_reference(
    backend: ModuleType, shape: Shape
) -> None:
    # A batch of one takes its own path in 16-bit on CPU (float32 matmuls).
    batch = _decode_batch(shape)
    for i, n in enumerate(batch.context_lens):
        out = backend.decode_attention(
            batch.q[i : i + 1],
            batch.k_cache,
            batch.v_cache,
            batch.padded_tables[i : i + 1, : len(batch.block_tables[i])],
            torch.tensor([n], dtype=torch.int64),
            n,
            shape.scale,
        )
        assert out.dtype == shape.dtype and out.shape == (1, shape.num_heads, HEAD_DIM)
        expected = reference_attention(
            batch.q[i : i + 1], batch.k[i], batch.v[i], [n - 1], shape.scale
        )
        _assert_matches_reference(out, expected, shape)


def test_decode_attention_ignores_cache_past_each_sequence(
    backend: ModuleType, shape: Shape
) -> None:
    batch = _decode_batch(shape)
    out = _decode(backend, batch, shape)

    for i, (table, n) in enumerate(zip(batch.block_tables, batch.context_lens, strict=True)):
        # Everything but sequence i's own tokens changes: the rest of its last block,
        # block 0 behind its padding, and the other sequences' blocks.
        k_garbage = _with_new_garbage(batch.k_cache, table, n, seed=30 + i)
        v_garbage = _with_new_garbage(batch.v_cache, table, n, seed=40 + i)
        again = _decode(backend, batch, shape, k_garbage, v_garbage)
        assert torch.equal(again[i], out[i])


# --- gather_kv (a helper of the torch reference only) ---


@pytest.mark.parametrize("context_len", [1, 5, 8, 11])
def test_gather_kv_returns_a_sequences_tokens_in_order(context_len: int) -> None:
    shape = Shape(block_size=4, group=1, dtype=torch.float32)
    block_table = [9, 0, 4]
    cache = _random_cache(shape, seed=50)
    dense = _randn(context_len, KV_HEADS, HEAD_DIM, dtype=torch.float32, seed=51)
    _write(cache, block_table, dense)
    table = torch.tensor(block_table, dtype=torch.int64)  # more blocks than short ones need

    assert torch.equal(torch_ref.gather_kv(cache, table, context_len), dense)
