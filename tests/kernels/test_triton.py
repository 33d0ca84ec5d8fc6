"""What only the Triton backend has: the split-K path, its launch checks, its selection.

The backend-generic cases (test_backends.py) already run it against the dense
reference; here the split count is forced, shapes stretch the kernels' padding
(a GQA group wider than 16 rows, a head_dim that is not a power of two), and the
launchers' refusals are checked word for word.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from tandem.errors import ConfigError
from tandem.kernels import resolve_backend, torch_ref
from tests.kernels.conftest import triton_backend_or_skip


@pytest.fixture(scope="module")
def triton_ops():
    return triton_backend_or_skip()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _randn(*size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _cache(num_blocks, block_size, kv_heads, head_dim, dtype, seed):
    """Random blocks plus the null block (the last, all zeros), as the engine's KV cache."""
    cache = _randn(num_blocks + 1, block_size, kv_heads, head_dim, dtype=dtype, seed=seed)
    cache[-1] = 0
    return cache


def _decode_inputs(dtype, kv_heads=2, group=3, head_dim=32, block_size=4, index=torch.int64):
    num_blocks = 16
    null = num_blocks
    lens = [1, 7, 8, 13, 30]
    tables = [[3], [9, 0], [12, 4], [1, 15, 2, 6], [5, 14, 8, 10, 7, 11, 13, 3]]
    width = 9  # every row padded with the null block
    padded = [t + [null] * (width - len(t)) for t in tables]
    k_cache = _cache(num_blocks, block_size, kv_heads, head_dim, dtype, seed=1)
    v_cache = _cache(num_blocks, block_size, kv_heads, head_dim, dtype, seed=2)
    q = _randn(len(lens), kv_heads * group, head_dim, dtype=dtype, seed=3)
    return (
        q,
        k_cache,
        v_cache,
        torch.tensor(padded, dtype=index),
        torch.tensor(lens, dtype=index),
        max(lens),
        1 / math.sqrt(head_dim),
    )


TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


def _expected_decode(args):
    q, k_cache, v_cache, tables, lens, max_len, scale = args
    return torch_ref.decode_attention(
        q.double(), k_cache.double(), v_cache.double(), tables.long(), lens.long(), max_len, scale
    )


@pytest.mark.parametrize("num_splits", [1, 2, 3, 30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_split_k_matches_reference(triton_ops, monkeypatch, num_splits, dtype):
    from tandem.kernels.triton import paged_decode

    merges = []
    merge = paged_decode._merge_kernel

    class Spy:
        def __getitem__(self, grid):
            merges.append(grid)
            return merge[grid]

    monkeypatch.setattr(paged_decode, "_merge_kernel", Spy())
    args = _decode_inputs(dtype)

    out = triton_ops.decode_attention(*args, num_splits=num_splits)

    torch.testing.assert_close(out.double(), _expected_decode(args), **TOL[dtype])
    # 30 splits of a 30-token context: one token each, most of them empty for short rows.
    assert len(merges) == (num_splits > 1)


@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim"),
    [(1, 20, 32), (2, 4, 24), (4, 1, 16)],
    ids=["group-wider-than-16", "head-dim-24", "no-gqa"],
)
def test_decode_odd_shapes(triton_ops, kv_heads, group, head_dim):
    args = _decode_inputs(torch.float32, kv_heads, group, head_dim, block_size=8)
    for splits in (1, 4):
        out = triton_ops.decode_attention(*args, num_splits=splits)
        torch.testing.assert_close(out.double(), _expected_decode(args), **TOL[torch.float32])


@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim"),
    [(1, 20, 32), (2, 4, 24)],
    ids=["group-of-20", "head-dim-24"],
)
@pytest.mark.parametrize(("context_len", "query_len"), [(45, 45), (45, 29), (45, 1)])
def test_prefill_odd_shapes_and_tiles(
    triton_ops, kv_heads, group, head_dim, context_len, query_len
):
    k_cache = _cache(16, 4, kv_heads, head_dim, torch.float32, seed=4)
    v_cache = _cache(16, 4, kv_heads, head_dim, torch.float32, seed=5)
    table = torch.tensor([11, 2, 7, 0, 15, 3, 9, 1, 14, 4, 6, 13], dtype=torch.int32)
    q = _randn(query_len, kv_heads * group, head_dim, dtype=torch.float32, seed=6)
    expected = torch_ref.prefill_attention(
        q.double(), k_cache.double(), v_cache.double(), table.long(), context_len, 0.3
    )
    for tiles in ({}, {"block_m": 32, "block_n": 16}, {"block_m": 16, "block_n": 32}):
        out = triton_ops.prefill_attention(q, k_cache, v_cache, table, context_len, 0.3, **tiles)
        torch.testing.assert_close(out.double(), expected, **TOL[torch.float32])


def test_int32_indices_give_the_same_result(triton_ops):
    args64 = _decode_inputs(torch.float32)
    args32 = _decode_inputs(torch.float32, index=torch.int32)
    assert torch.equal(triton_ops.decode_attention(*args32), triton_ops.decode_attention(*args64))
    k = _randn(3, 2, 32, dtype=torch.float32, seed=7)
    caches = [_cache(16, 4, 2, 32, torch.float32, seed=8) for _ in range(4)]
    slots = [5, 0, 63]
    triton_ops.store_kv(k, -k, caches[0], caches[1], torch.tensor(slots, dtype=torch.int32))
    torch_ref.store_kv(k, -k, caches[2], caches[3], torch.tensor(slots, dtype=torch.int64))
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_store_kv_casts_to_the_cache_dtype(triton_ops):
    k = _randn(2, 2, 16, dtype=torch.float32, seed=9)
    k_cache = torch.zeros(4, 4, 2, 16, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    triton_ops.store_kv(k, -k, k_cache, v_cache, torch.tensor([3, 8]))
    # Within one bf16 step: the interpreter truncates where torch and the GPU round.
    one_step = {"rtol": 2**-7, "atol": 0.0}
    torch.testing.assert_close(k_cache[0, 3].float(), k[0], **one_step)
    torch.testing.assert_close(v_cache[2, 0].float(), -k[1], **one_step)
    assert k_cache.count_nonzero() == v_cache.count_nonzero() == k.count_nonzero()


# --- launcher checks ---


def test_launchers_refuse_what_the_kernels_cannot_read(triton_ops):
    q, k_cache, v_cache, tables, lens, max_len, scale = _decode_inputs(torch.float32)

    def decode(**changes):
        args = dict(
            q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
            context_lens=lens, max_context_len=max_len, scale=scale,
        )  # fmt: skip
        args.update(changes)
        triton_ops.decode_attention(**args)

    cases = [
        ({"q": q.bfloat16()}, "q dtype torch.bfloat16 differs from the cache dtype torch.float32"),
        ({"q": q[..., :16]}, "q must be [tokens, num_heads, 32], got (5, 6, 16)"),
        ({"q": q[:, :5]}, "num_heads 5 is not a multiple of kv_heads 2"),
        ({"v_cache": v_cache.half()}, "k_cache and v_cache must share a dtype"),
        ({"block_tables": tables.float()}, "block_tables must be a 2-d int32/int64 tensor"),
        ({"context_lens": lens[:3]}, "must have one row per sequence (5)"),
        ({"max_context_len": 40}, "block_tables hold 9 blocks of 4, fewer than max_context_len 40"),
        (
            {"q": q.transpose(1, 2).contiguous().transpose(1, 2)},
            "q must be contiguous along head_dim",
        ),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError) as err:
            decode(**changes)
        assert message in str(err.value), (changes.keys(), str(err.value))

    with pytest.raises(ValueError, match=r"query_len 3 must be in \[1, context_len 2\]"):
        triton_ops.prefill_attention(q[:3], k_cache, v_cache, tables[4], 2, scale)
    with pytest.raises(ValueError, match="k must be"):
        triton_ops.store_kv(q, q[:, :2], k_cache, v_cache, torch.arange(5))


def test_cpu_tensors_need_the_interpreter(triton_ops, monkeypatch):
    from tandem.kernels.triton import common

    monkeypatch.setattr(common, "INTERPRET", False)
    with pytest.raises(ValueError, match="the triton backend runs on CUDA tensors, got cpu"):
        triton_ops.decode_attention(*_decode_inputs(torch.float32))


# --- split choice and backend selection ---


def test_num_splits_fills_the_device_only_when_the_batch_cannot():
    from tandem.kernels.triton.paged_decode import choose_num_splits

    # H200: 132 SMs. 8 KV heads (a 7B-style GQA model), 64-token tiles.
    assert choose_num_splits(1, 8, 4096, 132, 64) == 16  # capped by >= 256 tokens a split
    assert choose_num_splits(1, 8, 32768, 132, 64) == 33  # two programs per SM
    assert choose_num_splits(64, 8, 4096, 132, 64) == 1  # 512 programs already
    assert choose_num_splits(4, 8, 100, 132, 64) == 1  # too short to split
    assert choose_num_splits(1, 1, 10**6, 1000, 64) == 64  # at most MAX_SPLITS


def test_auto_picks_triton_on_cuda_and_the_others_elsewhere(monkeypatch):
    import tandem.kernels as kernels

    monkeypatch.setattr(kernels, "_load_cpu", lambda cache_dir: True)
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"
    monkeypatch.setattr(kernels, "_load_cpu", lambda cache_dir: False)
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("torch", torch.device("cuda")) == "torch"
    monkeypatch.setattr(kernels, "triton_installed", lambda: True)
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    monkeypatch.setattr(kernels, "triton_installed", lambda: False)
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    with pytest.raises(ConfigError, match="attention_backend 'triton' needs the triton package"):
        resolve_backend("triton", torch.device("cuda"))


def test_triton_on_cpu_without_the_interpreter_is_a_config_error(triton_ops, monkeypatch):
    assert resolve_backend("triton", torch.device("cpu")) == "triton"  # interpreted here
    monkeypatch.setattr(triton_ops, "INTERPRET", False)
    with pytest.raises(ConfigError, match="attention_backend 'triton' runs on CUDA devices, got"):
        resolve_backend("triton", torch.device("cpu"))


def test_every_launcher_runs_on_its_tensors_device_whatever_the_thread(monkeypatch):
    # Triton launches on the calling thread's current CUDA device, and the engine steps
    # on a thread of its own: a worker on cuda:1 launched every kernel on cuda:0.
    import contextlib
    import threading

    from tandem.kernels.triton import kv_store, paged_decode, paged_prefill

    entered = []

    @contextlib.contextmanager
    def device(d):
        entered.append((threading.current_thread().name, d))
        yield

    class OnGpu1:
        is_cuda, device = True, "cuda:1"

    monkeypatch.setattr(torch.cuda, "device", device)
    for launcher in (kv_store.store_kv, paged_decode.decode_attention,
                     paged_prefill.prefill_attention):  # fmt: skip
        entered.clear()
        thread = threading.Thread(target=lambda f=launcher: _swallow(f, OnGpu1()), name="step")
        thread.start()
        thread.join()
        assert entered == [("step", "cuda:1")], launcher.__name__


def _swallow(launcher, first) -> None:
    with contextlib.suppress(Exception):  # the stand-in is no tensor past the device check
        launcher(first, None, None, None, None, None, None)
