"""The int8 KV cache: its format (rotated rows, int8 values, a float16 scale after
each row), and every backend's store and attention over it.

The attention reference is the float64 dense one of test_backends.py over the K and
V that the cache holds (dequantized and rotated back), so the kernels are checked to
the same tolerances as over a float cache; a separate case bounds how far that is
from the K and V before quantization.
"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from tandem.kernels import torch_ref
from tests.kernels.test_backends import TOLERANCES, reference_attention

# Every backend that runs here (the backend fixture, conftest.py), on one thread.
pytestmark = pytest.mark.usefixtures("one_thread")

KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 32, 4, 12
WIDTH = HEAD_DIM + torch_ref.INT8_SCALE_BYTES


def _randn(*size: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _held(rows: torch.Tensor) -> torch.Tensor:
    """What int8 cache rows hold, in float64 and unrotated: the K or V they stand for."""
    return torch_ref.rotate(torch_ref.dequantize(rows, torch.float64))


def _empty_cache() -> torch.Tensor:
    return torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, WIDTH, dtype=torch.int8)


# --- the format ---


@pytest.mark.parametrize("dim", [1, 32, 64, 80, 96, 128])
def test_the_rotation_is_orthonormal_and_its_own_inverse(dim: int) -> None:
    x = _randn(5, dim, seed=1, dtype=torch.float64)
    y = torch_ref.rotate(x)  # computed in float32
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch_ref.rotate(y), x, rtol=1e-5, atol=1e-6)
    dense = x @ torch_ref._hadamard(dim, torch.device("cpu"), torch.float64)  # what CUDA uses
    torch.testing.assert_close(y, dense, rtol=1e-5, atol=1e-6)


def test_quantized_rows_hold_values_and_a_float16_scale() -> None:
    x = torch.tensor([[1.0, -0.5, 0.25, 127.0], [0.0, 0.0, 0.0, 0.0]])
    rows = torch_ref.quantize_int8(x)
    assert rows.dtype == torch.int8 and rows.shape == (2, 4 + torch_ref.INT8_SCALE_BYTES)
    scales = rows[:, 4:].contiguous().view(torch.float16).flatten()
    assert scales.tolist() == [1.0, 0.0]  # absmax / 127; an all-zero row gets 0
    assert rows[0, :4].tolist() == [1, 0, 0, 127]  # floor(x / scale + 0.5)
    assert torch_ref.dequantize(rows, torch.float32)[1].tolist() == [0.0] * 4


def test_quantization_error_is_within_half_a_step_of_the_rows_scale() -> None:
    x = _randn(64, KV_HEADS, HEAD_DIM, seed=2) * torch.logspace(-3, 3, 64)[:, None, None]
    rows = torch_ref.quantize_int8(x)
    scale = rows[..., HEAD_DIM:].contiguous().view(torch.float16).float()
    error = (torch_ref.dequantize(rows, torch.float32) - x).abs()
    assert (error <= scale * 0.5 + 1e-6 * x.abs()).all()


def test_huge_values_saturate_instead_of_overflowing_the_scale() -> None:
    rows = torch_ref.quantize_int8(torch.tensor([[1e9, -1e9, 1.0, 0.0]]))
    assert torch.isfinite(torch_ref.dequantize(rows, torch.float32)).all()


def test_a_rotated_int8_row_is_close_to_the_row_it_stands_for() -> None:
    # A row with one dominant channel, as K rows have: the rotation spreads it, so the
    # small channels keep their precision (without it their error is ~scale / 2 of the
    # dominant channel).
    x = _randn(256, 1, 64, seed=3, dtype=torch.float64)
    x[..., 5] *= 30
    rows = torch_ref.quantize_int8(torch_ref.rotate(x.float()))
    rotated = (_held(rows) - x).norm() / x.norm()
    plain = (torch_ref.dequantize(torch_ref.quantize_int8(x.float()), torch.float64) - x).norm()
    assert rotated < 0.5 * plain / x.norm()
    assert rotated < 0.01


# --- the backends ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_quantizes_exactly_the_given_slots_as_the_reference(
    backend: ModuleType, dtype: torch.dtype
) -> None:
    slots = torch.tensor([5 * BLOCK_SIZE + 1, 0, NUM_BLOCKS * BLOCK_SIZE - 1, 9 * BLOCK_SIZE + 2])
    k = _randn(len(slots), KV_HEADS, HEAD_DIM, seed=4, dtype=dtype)
    v = 50 * _randn(len(slots), KV_HEADS, HEAD_DIM, seed=5, dtype=dtype)
    k_cache = _randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, WIDTH, seed=6).mul(40).to(torch.int8)
    v_cache = k_cache.clone()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots.tolist()):
        expected_k[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = torch_ref.quantize_int8(
            torch_ref.rotate(k[i].float())
        )
        expected_v[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = torch_ref.quantize_int8(
            torch_ref.rotate(v[i].float())
        )

    backend.store_kv(k, v, k_cache, v_cache, slots)

    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)
    held = _held(k_cache.view(-1, KV_HEADS, WIDTH)[slots])
    assert (held - k.double()).abs().max() < 0.05  # |k| < ~4: steps of ~0.03


def _sequence(context_len: int, seed: int, dtype: torch.dtype):
    """A sequence's K and V stored in an int8 cache through shuffled blocks."""
    table = [7, 2, 11, 5, 0, 9, 3, 10, 1, 6][: -(-context_len // BLOCK_SIZE)]
    k = _randn(context_len, KV_HEADS, HEAD_DIM, seed=seed, dtype=dtype)
    v = _randn(context_len, KV_HEADS, HEAD_DIM, seed=seed + 1, dtype=dtype)
    k_cache, v_cache = _empty_cache(), _empty_cache()
    slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                          for p in range(context_len)])  # fmt: skip
    torch_ref.store_kv(k, v, k_cache, v_cache, slots)
    held_k = _held(k_cache.view(-1, KV_HEADS, WIDTH)[slots])
    held_v = _held(v_cache.view(-1, KV_HEADS, WIDTH)[slots])
    return table, k, v, k_cache, v_cache, held_k, held_v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_prefill_attention_over_an_int8_cache(
    backend: ModuleType, dtype: torch.dtype, group: int
) -> None:
    context_len, query_len = 2 * BLOCK_SIZE + 3, 5  # a prefix and a chunk across a boundary
    table, k, v, k_cache, v_cache, held_k, held_v = _sequence(context_len, 10, dtype)
    q = _randn(query_len, KV_HEADS * group, HEAD_DIM, seed=12, dtype=dtype)
    scale = 1 / math.sqrt(HEAD_DIM)

    out = backend.prefill_attention(q, k_cache, v_cache, torch.tensor(table), context_len, scale)

    assert out.dtype == dtype and out.shape == q.shape
    positions = list(range(context_len - query_len, context_len))
    expected = reference_attention(q, held_k, held_v, positions, scale)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])
    unquantized = reference_attention(q, k, v, positions, scale)
    assert (out.double() - unquantized).abs().max() < 0.03


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize(
    "context_len, query_len",
    [(5, 5), (2 * BLOCK_SIZE + 3, 5), (39, 33)],  # no prefix; one; query and key tiles of 16
)
def test_prefill_over_an_int8_cache_attends_the_new_tokens_as_computed(
    backend: ModuleType, dtype: torch.dtype, group: int, context_len: int, query_len: int
) -> None:
    table, k, v, k_cache, v_cache, held_k, held_v = _sequence(context_len, 40, dtype)
    q = _randn(query_len, KV_HEADS * group, HEAD_DIM, seed=41, dtype=dtype)
    scale = 1 / math.sqrt(HEAD_DIM)
    prefix = context_len - query_len

    out = backend.prefill_attention(
        q, k_cache, v_cache, torch.tensor(table), context_len, scale,
        new_kv=(k[prefix:], v[prefix:]),
    )  # fmt: skip

    assert out.dtype == dtype and out.shape == q.shape
    # The prefix as the cache holds it, the new tokens as they were computed.
    keys = torch.cat([held_k[:prefix], k[prefix:].double()])
    values = torch.cat([held_v[:prefix], v[prefix:].double()])
    positions = list(range(prefix, context_len))
    expected = reference_attention(q, keys, values, positions, scale)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])
    if dtype == torch.float32:  # and not what the stored rows give
        stored = reference_attention(q, held_k, held_v, positions, scale)
        assert (out.double() - stored).abs().max() > 10 * TOLERANCES[dtype]["atol"]


def test_prefill_over_a_float_cache_reads_the_new_tokens_from_it(backend: ModuleType) -> None:
    """A float cache holds the new tokens exactly: ``new_kv`` changes nothing."""
    context_len, query_len = 2 * BLOCK_SIZE + 3, 5
    k_cache = _randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, seed=50)
    v_cache = _randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, seed=51)
    table = torch.tensor([7, 2, 11])
    q = _randn(query_len, KV_HEADS, HEAD_DIM, seed=52)
    ignored = torch.full((query_len, KV_HEADS, HEAD_DIM), 1e3)

    read = backend.prefill_attention(q, k_cache, v_cache, table, context_len, 0.2)
    given = backend.prefill_attention(
        q, k_cache, v_cache, table, context_len, 0.2, new_kv=(ignored, ignored)
    )

    assert torch.equal(given, read)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_attention_over_an_int8_cache(
    backend: ModuleType, dtype: torch.dtype, group: int
) -> None:
    lens = [1, 2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 3]
    q = _randn(len(lens), KV_HEADS * group, HEAD_DIM, seed=20, dtype=dtype)
    scale = 1 / math.sqrt(HEAD_DIM)
    # One sequence per call of _sequence, each in its own cache: stack them along blocks.
    seqs = [_sequence(n, 30 + 2 * i, dtype) for i, n in enumerate(lens)]
    k_cache = torch.cat([s[3] for s in seqs])
    v_cache = torch.cat([s[4] for s in seqs])
    width = max(len(s[0]) for s in seqs) + 1
    tables = torch.tensor(
        [[b + i * NUM_BLOCKS for b in s[0]] + [0] * (width - len(s[0])) for i, s in enumerate(seqs)]
    )

    lens_t = torch.tensor(lens)
    out = backend.decode_attention(q, k_cache, v_cache, tables, lens_t, max(lens), scale)

    assert out.dtype == dtype and out.shape == q.shape
    for i, (n, s) in enumerate(zip(lens, seqs, strict=True)):
        expected = reference_attention(q[i : i + 1], s[5], s[6], [n - 1], scale)
        torch.testing.assert_close(out[i : i + 1].double(), expected, **TOLERANCES[dtype])
        unquantized = reference_attention(q[i : i + 1], s[1], s[2], [n - 1], scale)
        assert (out[i : i + 1].double() - unquantized).abs().max() < 0.03


@pytest.mark.parametrize("head_dim", [64, 80, 96])
def test_the_cpu_store_is_the_reference_bit_for_bit_for_any_head_size(head_dim: int) -> None:
    # 80 and 96 rotate in two Hadamard blocks (64 + 16, 64 + 32), in C as in torch.
    from tests.kernels.conftest import cpu_backend_or_skip

    cpu = cpu_backend_or_skip()
    k = _randn(9, KV_HEADS, head_dim, seed=60, dtype=torch.bfloat16)
    v = _randn(9, KV_HEADS, head_dim, seed=61, dtype=torch.bfloat16)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:9]
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, head_dim + 2)
    caches = [torch.zeros(shape, dtype=torch.int8) for _ in range(4)]
    torch_ref.store_kv(k, v, caches[0], caches[1], slots)
    cpu.store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_the_cpu_store_refuses_shapes_it_would_write_past() -> None:
    from tests.kernels.conftest import cpu_backend_or_skip

    cpu = cpu_backend_or_skip()
    k = _randn(3, KV_HEADS, HEAD_DIM, seed=62)
    cache = _empty_cache()
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="is not k's"):
        cpu.store_kv(k, k[:, :1], cache, cache.clone(), slots)
    narrow = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.int8)
    with pytest.raises(ValueError, match="do not hold"):
        cpu.store_kv(k, k, narrow, narrow.clone(), slots)
    with pytest.raises(ValueError, match="slots for 3 tokens"):
        cpu.store_kv(k, k, cache, cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="a slot outside"):
        cpu.store_kv(k, k, cache, cache.clone(), torch.tensor([0, 1, NUM_BLOCKS * BLOCK_SIZE]))
