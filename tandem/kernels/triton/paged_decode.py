"""Paged decode attention: each sequence's newest token over its cached context.

Grid: (sequence, KV head, split). A program loads its sequence's K/V tiles once for
the whole GQA group (the query heads sharing that KV head, padded to 16 rows for
``tl.dot``) and runs an online softmax over them, reading blocks in place through
the block table. When batch x KV heads is too few programs to fill the GPU, the
context is cut into ``num_splits`` ranges (flash-decoding): each split writes its
partial output and log-sum-exp in float32, and a second kernel merges them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.torch_ref import on_rotated_kv
from tandem.kernels.triton.common import (
    INTERPRET,
    LOG2E,
    attend_tile,
    block_d,
    check_cache,
    check_device,
    check_index,
    check_query,
    is_quantized,
    num_sms,
    on_its_device,
    widen,
)

# A split shorter than this costs more in the merge than it gains in parallelism.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64


@triton.jit(do_not_specialize=["split_len", "num_splits"])
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    part_out_ptr,  # [batch, heads, splits, BLOCK_D] float32, contiguous (SPLIT only)
    part_lse_ptr,  # [batch, heads, splits] float32, contiguous (SPLIT only)
    scale_log2,  # softmax scale x log2(e): the softmax runs in base 2
    split_len,  # tokens per split (a multiple of BLOCK_N unless shorter than it)
    num_splits,
    stride_qb,
    stride_qh,
    stride_kb,  # cache strides: block, token, head (head_dim is contiguous)
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    WIDEN: tl.constexpr,
    QUANT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + b).to(tl.int32)
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    row_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    # Lanes past HEAD_DIM (a head_dim of 80 or 96 in tiles of 128) go into tl.dot: zero,
    # not whatever a masked load leaves there (Triton does not define it).
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0
    )

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = tables_ptr + b * stride_tb
    # Every tile holds at least one valid token, so m is finite after the first one.
    # The newest token sees the whole context: a causal mask at position end - 1 is
    # exactly "keys before end", which masks the last, partial tile.
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + end - 1
    for n0 in range(start, end, BLOCK_N):
        m, lsum, acc = attend_tile(
            q, m, lsum, acc, n0, q_pos, end, table, k_ptr, v_ptr, kv_head,
            scale_log2, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, True, WIDEN, QUANT,
        )  # fmt: skip

    if SPLIT:
        # An empty split (past this sequence's end) leaves lsum = 0 and m = -inf: its
        # partial is 0 with weight exp2(-inf) = 0 in the merge.
        empty = lsum == 0.0
        part = acc / tl.where(empty, 1.0, lsum)[:, None]
        lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, lsum)))
        row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], part, mask=row_mask)
        tl.store(part_lse_ptr + row, lse, mask=g < GROUP)
    else:
        out = acc / lsum[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )


@triton.jit
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (b * tl.num_programs(1) + h) * num_splits + s
    lse = tl.load(part_lse_ptr + row, mask=s < num_splits, other=float("-inf"))
    # Split 0 starts at token 0 and every sequence has a token: the max is finite.
    weight = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(
        part_out_ptr + row[:, None] * BLOCK_D + d[None, :],
        mask=(s[:, None] < num_splits) & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def choose_num_splits(
    batch: int, kv_heads: int, max_context_len: int, num_sms: int, block_n: int
) -> int:
    """Enough splits for about two programs per SM, none shorter than MIN_SPLIT_TOKENS."""
    wanted = -(-2 * num_sms // (batch * kv_heads))
    by_length = max(1, max_context_len // max(MIN_SPLIT_TOKENS, block_n))
    return max(1, min(wanted, by_length, MAX_SPLITS))


@on_its_device
@on_rotated_kv
def decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks], int32/int64, padded with any valid id
    context_lens: torch.Tensor,  # [batch], int32/int64, includes the new token, each >= 1
    max_context_len: int,  # max(context_lens), known to the caller without a device sync
    scale: float,
    *,
    num_splits: int | None = None,  # None: chosen from the batch and the device
    block_n: int | None = None,  # tuning knobs, for the benchmark
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of each sequence's newest token over its cached context.

    The interface of :func:`tandem.kernels.torch_ref.decode_attention`. Tokens past a
    sequence's length are never read. Returns [batch, num_heads, head_dim] in q's dtype.
    """
    check_cache(k_cache, v_cache)
    group = check_query(q, k_cache)
    check_index(block_tables, "block_tables", 2)
    check_index(context_lens, "context_lens", 1)
    check_device(q, k_cache, v_cache, block_tables, context_lens)
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if block_tables.shape[0] != batch or context_lens.shape[0] != batch:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and context_lens "
            f"{tuple(context_lens.shape)} must have one row per sequence ({batch})"
        )
    if block_tables.shape[1] * block_size < max_context_len:
        raise ValueError(
            f"block_tables hold {block_tables.shape[1]} blocks of {block_size}, "
            f"fewer than max_context_len {max_context_len} tokens"
        )
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if max_context_len < 1:
        raise ValueError(f"max_context_len must be >= 1, got {max_context_len}")

    bd = block_d(head_dim)
    if block_n is None:
        block_n = 16 if INTERPRET else (64 if bd <= 128 else 32)
    splits = num_splits or choose_num_splits(
        batch, kv_heads, max_context_len, num_sms(q.device), block_n
    )
    splits = max(1, min(splits, max_context_len))
    # Whole tiles per split where splits are long enough (aligned loads); the last split
    # may be short, and none is empty for the longest sequence.
    split_len = -(-max_context_len // splits)
    if split_len > block_n:
        split_len = -(-split_len // block_n) * block_n
    splits = -(-max_context_len // split_len)

    part_out = part_lse = out  # unused placeholders when there is one split
    if splits > 1:
        part_out = torch.empty(batch, num_heads, splits, bd, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        split_len,
        splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=bd,
        BLOCK_N=block_n,
        SPLIT=splits > 1,
        WIDEN=widen(q.dtype),
        QUANT=is_quantized(k_cache),
        num_warps=num_warps or 4,
        num_stages=num_stages or 2,
    )
    if splits > 1:
        _merge_kernel[(batch, num_heads)](
            part_out,
            part_lse,
            out,
            splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=bd,
            BLOCK_S=triton.next_power_of_2(splits),
            num_warps=4 if bd >= 128 else 1,
        )
    return out
