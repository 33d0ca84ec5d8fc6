"""Paged prefill attention: causal flash-attention of a sequence's new tokens.

The new tokens are the last ``query_len`` of ``context_len``; the first
``context_len - query_len`` (an earlier chunk, a prefix-cache hit) are already in
cached blocks, and every key is read in place through the block table.

Grid: (query tile, head), heaviest tiles first. A tile of BLOCK_M query rows at
positions ``prefix + row`` runs an online softmax over key tiles of BLOCK_N: the
tiles every row sees whole come first with no mask, then the ones across the
causal diagonal with it.

Over an int8 cache with the new tokens' K/V as computed (``new_kv``), only the
cached prefix is read through the block table (quantized), and the new tokens
attend to each other's exact K/V (tandem/kernels/torch_ref.py says why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.torch_ref import on_rotated_kv, rotate
from tandem.kernels.triton.common import (
    INTERPRET,
    LOG2E,
    attend_new_tile,
    attend_tile,
    block_d,
    check_cache,
    check_device,
    check_index,
    check_query,
    is_quantized,
    max_shared_memory,
    on_its_device,
    widen,
)


# Lengths vary every call: compiling a variant per divisibility-by-16 buys nothing.
@triton.jit(do_not_specialize=["query_len", "context_len"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    out_ptr,
    new_k_ptr,  # NEW: the new tokens' K and V as computed, [query_len, kv_heads, head_dim]
    new_v_ptr,
    scale_log2,  # softmax scale x log2(e): the softmax runs in base 2
    query_len,
    context_len,
    stride_nt,  # the new K and V's strides: token, head
    stride_nh,
    stride_qt,
    stride_qh,
    stride_kb,  # cache strides: block, token, head (head_dim is contiguous)
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WIDEN: tl.constexpr,
    QUANT: tl.constexpr,
    NEW: tl.constexpr,
):
    # The last query tiles see the most keys: start them first.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    prefix = context_len - query_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q_mask = (rows[:, None] < query_len) & (d[None, :] < HEAD_DIM)
    q_off = rows[:, None].to(tl.int64) * stride_qt + head * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    q_pos = prefix + rows  # padding rows past query_len see keys up to context_len only

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if NEW:
        # Only the cached prefix is read through the table, all of it visible to every
        # row: just the tile across its end masks (the keys past it). The new keys
        # follow, as computed.
        keys = prefix
        whole = prefix // BLOCK_N * BLOCK_N
        end = prefix
    else:
        # Keys below the tile's first position are visible to every row of the tile.
        keys = context_len
        whole = (prefix + tile * BLOCK_M) // BLOCK_N * BLOCK_N
        end = tl.minimum(prefix + (tile + 1) * BLOCK_M, context_len)
    for n0 in range(0, whole, BLOCK_N):
        m, lsum, acc = attend_tile(
            q, m, lsum, acc, n0, q_pos, keys, table_ptr, k_ptr, v_ptr, kv_head,
            scale_log2, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, False, WIDEN, QUANT,
        )  # fmt: skip
    for n0 in range(whole, end, BLOCK_N):
        m, lsum, acc = attend_tile(
            q, m, lsum, acc, n0, q_pos, keys, table_ptr, k_ptr, v_ptr, kv_head,
            scale_log2, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, True, WIDEN, QUANT,
        )  # fmt: skip
    if NEW:
        for j0 in range(0, tl.minimum((tile + 1) * BLOCK_M, query_len), BLOCK_N):
            m, lsum, acc = attend_new_tile(
                q, m, lsum, acc, j0, rows, query_len, new_k_ptr, new_v_ptr, kv_head,
                scale_log2, stride_nt, stride_nh, HEAD_DIM, BLOCK_N, BLOCK_D, WIDEN,
            )  # fmt: skip
    # Key 0 is in the first tile read (a cached one, or new key 0) and visible to every
    # row, so m is finite from then on.

    out = acc / lsum[:, None]
    o_off = rows[:, None].to(tl.int64) * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)


# What the large tiles take at head_dim 128 (tests/kernels/gpu_compile.py): they do
# not load on a device with less shared memory per program (Turing's 64 KiB).
LARGE_TILES_SHARED = 96 * 1024


def default_tiles(
    head_dim: int, query_len: int, dtype: torch.dtype, max_shared: int = LARGE_TILES_SHARED
) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) for this head size and prompt length,
    on a device with ``max_shared`` bytes of shared memory per program."""
    if INTERPRET:
        return 16, 16, 1, 1
    if dtype == torch.float32:  # a checking dtype, not a serving one: keep shared memory small
        return 64, 32, 4, 2
    if head_dim > 128:  # twice the rows of K and V per tile (compiled sizes: gpu_compile.py)
        if max_shared >= 160 * 1024:  # Ampere's A100, Hopper
            return 128, 64, 8, 3
        return (64, 64, 4, 2) if max_shared >= 72 * 1024 else (32, 32, 4, 2)
    if query_len <= 64 or max_shared < LARGE_TILES_SHARED:
        return 64, 64, 4, 2
    if head_dim <= 64:
        return 128, 64, 4, 3
    return 128, 64, 8, 3


@on_its_device
@on_rotated_kv
def prefill_attention(
    q: torch.Tensor,  # [query_len, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [n_blocks], int32/int64
    context_len: int,
    scale: float,
    *,
    block_m: int | None = None,  # tuning knobs, for the benchmark
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its whole cached context.

    The interface of :func:`tandem.kernels.torch_ref.prefill_attention`: the new
    tokens' K/V must already be stored, and an int8 cache's attention takes them from
    ``new_kv`` as computed. Returns [query_len, num_heads, head_dim].
    """
    check_cache(k_cache, v_cache)
    group = check_query(q, k_cache)
    check_index(block_table, "block_table", 1)
    check_device(q, k_cache, v_cache, block_table)
    query_len, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    if not 1 <= query_len <= context_len:
        raise ValueError(f"query_len {query_len} must be in [1, context_len {context_len}]")
    if block_table.shape[0] * block_size < context_len:
        raise ValueError(
            f"block_table holds {block_table.shape[0]} blocks of {block_size}, "
            f"fewer than context_len {context_len} tokens"
        )
    new = new_kv is not None and is_quantized(k_cache)
    if new:
        # Rotated as the cache's rows are; fresh contiguous tensors, so K's strides are V's.
        new_k, new_v = (rotate(x.to(q.dtype)) for x in new_kv)
        if new_k.shape != (query_len, k_cache.shape[2], head_dim) or new_v.shape != new_k.shape:
            raise ValueError(
                f"new_kv must be two [query_len, kv_heads, head_dim] = "
                f"[{query_len}, {k_cache.shape[2]}, {head_dim}], got "
                f"{tuple(new_kv[0].shape)} and {tuple(new_kv[1].shape)}"
            )
        check_device(q, new_k, new_v)
    else:
        new_k = new_v = q  # not read
    shared = LARGE_TILES_SHARED if INTERPRET else max_shared_memory(q.device)
    bm, bn, warps, stages = default_tiles(head_dim, query_len, q.dtype, shared)
    bm, bn = block_m or bm, block_n or bn
    out = torch.empty_like(q)
    grid = (triton.cdiv(query_len, bm), num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_table,
        out,
        new_k,
        new_v,
        scale * LOG2E,
        query_len,
        context_len,
        new_k.stride(0),
        new_k.stride(1),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=block_d(head_dim),
        WIDEN=widen(q.dtype),
        QUANT=is_quantized(k_cache),
        NEW=new,
        num_warps=num_warps or warps,
        num_stages=num_stages or stages,
    )
    return out
