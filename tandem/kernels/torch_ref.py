"""Reference attention and KV-store ops in plain PyTorch (any device).

Paged KV layout, one tensor per layer for K and one for V:
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A token's *slot* is ``block_id * block_size + offset``.
These functions are the correctness reference for the Triton kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens], int64
) -> None:
    """Write each token's K/V into its slot of the paged cache."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_table: torch.Tensor,  # [n_blocks], int64
    context_len: int,
) -> torch.Tensor:
    """One sequence's first ``context_len`` cached tokens: [context_len, kv_heads, head_dim]."""
    # index_select, not cache[block_table]: the same copy, several times faster on CPU.
    return cache.index_select(0, block_table).flatten(0, 1)[:context_len]


def prefill_attention(
    q: torch.Tensor,  # [query_len, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [n_blocks], int64
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its whole cached context.

    The new tokens are the last ``query_len`` of ``context_len`` and must already be
    stored; the first ``context_len - query_len`` are a cached prefix (an earlier
    chunk, a prefix-cache hit, or KV that arrived from a prefill worker).
    Returns [query_len, num_heads, head_dim].
    """
    query_len = q.shape[0]
    # A leading batch dim of 1: 4-D inputs take SDPA's fused CPU kernel, 3-D the slow path.
    k = gather_kv(k_cache, block_table, context_len).transpose(0, 1)[None]  # [1, kvh, ctx, d]
    v = gather_kv(v_cache, block_table, context_len).transpose(0, 1)[None]
    qh = q.transpose(0, 1)[None]  # [1, heads, query_len, d]
    if query_len == context_len:
        mask, causal = None, True
    else:
        prefix = context_len - query_len
        rows = torch.arange(query_len, device=q.device)[:, None] + prefix
        mask, causal = torch.arange(context_len, device=q.device)[None, :] <= rows, False
    out = F.scaled_dot_product_attention(
        qh,
        k.to(q.dtype),
        v.to(q.dtype),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks], int64, padded with any valid id
    context_lens: torch.Tensor,  # [batch], int64, includes the new token
    max_context_len: int,  # max(context_lens), known to the caller without a device sync
    scale: float,
) -> torch.Tensor:
    """Attention of each sequence's newest token over its cached context.

    Sequences have different lengths; positions past a sequence's length are masked
    and must hold finite values (the cache zeroes blocks when it allocates them).
    Returns [batch, num_heads, head_dim].
    """
    # [batch, S, kv_heads, head_dim] -> [batch, kv_heads, S, head_dim] (a strided view)
    batch, width = block_tables.shape
    flat = block_tables.flatten()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # index_select over flat ids is several times faster than cache[block_tables]; the
        # contiguous copy costs less than the strided matmul it spares (a copy inside it).
        blocks = cache.index_select(0, flat).view(batch, width * cache.shape[1], *cache.shape[2:])
        return blocks[:, :max_context_len].transpose(1, 2).contiguous()

    k, v = gather(k_cache).to(q.dtype), gather(v_cache).to(q.dtype)
    padding = None
    if batch > 1:
        positions = torch.arange(max_context_len, device=q.device)
        padding = positions[None, :] >= context_lens[:, None]  # [batch, S]
    if q.dtype == torch.float32 or q.device.type != "cpu":
        mask = None if padding is None else ~padding[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out[:, :, 0]
    # 16-bit on CPU: two batched matmuls with a float32 softmax between them. PyTorch's
    # fused CPU attention (flash) is built for long queries; for one query row per
    # sequence in bfloat16 it was 1.3-4.5x slower (bench/decode_attention.py), while in
    # float32 it is the faster of the two. One sequence alone computes in float32
    # throughout: a bfloat16 batched matmul has a fixed cost that dominates a single
    # small product, and the float32 copies of one sequence's K and V are cheap.
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, dtype = k.shape[1], q.dtype
    if batch == 1:
        q, k, v = q.float(), k.float(), v.float()
    # GQA: query head h reads KV head h // group, as SDPA's enable_gqa does.
    qg = q.view(batch, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [batch, kv_heads, g, S]
    if padding is not None:
        scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v).view(batch, num_heads, head_dim)
    return out.to(dtype)
