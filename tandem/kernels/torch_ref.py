"""Reference attention and KV-store ops in plain PyTorch (any device).

Paged KV layout, one tensor per layer for K and one for V:
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A token's *slot* is ``block_id * block_size + offset``.
These functions are the correctness reference for the Triton kernels.

An int8 cache (``kv_cache_dtype: int8``) holds each token's K (or V) of one head as
``head_dim`` int8 values followed by their float16 scale, two more bytes:
``[num_blocks, block_size, kv_heads, head_dim + 2]`` int8, value = int8 x scale with
scale = absmax / 127 of that row. Per token and head, so that a token's scale is
fixed when it is stored (a per-block scale would requantize the block's earlier
tokens whenever a later one is larger), and the row carries its own scale, so that
every block holds, and a KV transfer moves, its scales with its values.

Before quantization each row is rotated by a normalized Hadamard matrix H
(``rotate``; H = H^T = H^-1). A few channels of K carry most of its magnitude,
and one scale per row spends the int8 range on them; the rotation spreads them
over all channels, which halved the greedy divergence from the float cache on the
default model (bench/kv_int8.py). Attention needs no unrotation of K or V:
scores are (qH).(kH) = q.k, so the query is rotated instead, and the output,
a sum of rotated V rows, is rotated back once.

Prefill attention over an int8 cache takes the new tokens' own K and V as computed
(``new_kv``), not as stored: only the cached prefix is read back quantized. A
prompt's later layers are then computed from exact attention over the prompt, so
its stored KV carries one rounding, not the rounding of every layer below
compounded; on the default model that took greedy agreement with the float cache
from 0.75 to 0.81 and halved the perplexity cost (bench/README.md, "int8 KV
cache"). A float cache holds the new tokens exactly, and is read as it is.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tandem.kernels import INT8_SCALE_BYTES

_FLOAT16_MAX = 65504.0


def row_width(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements of one token's K (or V) of one head in a cache of ``cache_dtype``."""
    return head_dim + INT8_SCALE_BYTES if cache_dtype == torch.int8 else head_dim


@functools.cache
def _hadamard(dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Orthonormal and symmetric: a block-diagonal of Sylvester Hadamard matrices, one
    per power of two in ``dim`` (one block when dim is a power of two)."""
    blocks = []
    for n in _segments(dim):
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        blocks.append(h / n**0.5)
    return torch.block_diag(*blocks).to(device=device, dtype=dtype)


def _segments(dim: int) -> list[int]:
    """The Hadamard blocks of ``dim``: one per power of two in it, largest first."""
    return [1 << bit for bit in reversed(range(dim.bit_length())) if dim >> bit & 1]


def _walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` for float32 ``x`` by the fast transform: per block, log2(n) stages of
    a + b, a - b, then a multiply by 1 / sqrt(n); the cpu backend's C code does the
    same operations in the same order, so both store bit-identical rows."""
    parts, start = [], 0
    for n in _segments(x.shape[-1]):
        y = x[..., start : start + n]
        lead = y.shape[:-1]
        h = 1
        while h < n:
            y = y.reshape(*lead, n // (2 * h), 2, h)
            a, b = y[..., 0, :], y[..., 1, :]
            y = torch.stack((a + b, a - b), dim=-2)
            h *= 2
        parts.append(y.reshape(*lead, n) * torch.tensor(n**-0.5, dtype=torch.float32))
        start += n
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` over the last dim, computed in float32 and returned in x's dtype; its
    own inverse. On CUDA one matmul; elsewhere the fast transform (``_walsh_hadamard``)."""
    if x.is_cuda:
        return (x.float() @ _hadamard(x.shape[-1], x.device, torch.float32)).to(x.dtype)
    return _walsh_hadamard(x.float()).to(x.dtype)


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] floats -> [..., head_dim + 2] int8 rows: values, then the scale.

    value = floor(x / scale + 0.5) clamped to +-127, with the float16 scale absmax / 127
    (the rounded scale, so that x ~ value x scale holds for the stored scale); an
    all-zero row gets scale 0. The Triton store computes the same.
    """
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 127).clamp(max=_FLOAT16_MAX).half()
    s = scale.float()
    q = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0)
    q = torch.floor(q + 0.5).clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as ``dtype``: an int8 cache's values times their scales, else a cast."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., head_dim:].view(torch.float16).float()  # head_dim is even
    return (rows[..., :head_dim].float() * scale).to(dtype)


def on_rotated_kv(attention):
    """Attention over an int8 cache's rotated rows: the query rotated in, the output
    rotated back (see the module docstring); a float cache is attended as it is."""

    @functools.wraps(attention)
    def attend(q: torch.Tensor, k_cache: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if k_cache.dtype != torch.int8:
            return attention(q, k_cache, *args, **kwargs)
        return rotate(attention(rotate(q), k_cache, *args, **kwargs))

    return attend


def store_kv(
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens], int64
) -> None:
    """Write each token's K/V into its slot of the paged cache (an int8 cache: rotated
    and quantized)."""
    if k_cache.dtype == torch.int8:
        k, v = quantize_int8(rotate(k.float())), quantize_int8(rotate(v.float()))
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_table: torch.Tensor,  # [n_blocks], int64
    context_len: int,
) -> torch.Tensor:
    """One sequence's first ``context_len`` cached rows: [context_len, kv_heads, row width]."""
    # index_select, not cache[block_table]: the same copy, several times faster on CPU.
    return cache.index_select(0, block_table).flatten(0, 1)[:context_len]


def context_kv(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    new: torch.Tensor | None,  # [query_len, kv_heads, head_dim]: the last rows as computed
    dtype: torch.dtype,
) -> torch.Tensor:
    """A sequence's K (or V) for prefill attention: [context_len, kv_heads, head_dim]
    in ``dtype``, its last rows from ``new`` where the cache is int8 (rotated, as the
    cache's rows are), else all from the cache."""
    if new is None or cache.dtype != torch.int8:
        return dequantize(gather_kv(cache, block_table, context_len), dtype)
    prefix = gather_kv(cache, block_table, context_len - new.shape[0])
    return torch.cat([dequantize(prefix, dtype), rotate(new.to(dtype))])


@on_rotated_kv
def prefill_attention(
    q: torch.Tensor,  # [query_len, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [n_blocks], int64
    context_len: int,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its whole cached context.

    The new tokens are the last ``query_len`` of ``context_len`` and must already be
    stored; the first ``context_len - query_len`` are a cached prefix (an earlier
    chunk, a prefix-cache hit, or KV that arrived from a prefill worker).
    ``new_kv``: the new tokens' K and V as computed ([query_len, kv_heads, head_dim],
    q's dtype), which an int8 cache's attention uses instead of their stored rows
    (the module docstring). Returns [query_len, num_heads, head_dim].
    """
    query_len = q.shape[0]
    # A leading batch dim of 1: 4-D inputs take SDPA's fused CPU kernel, 3-D the slow path.
    k, v = (
        context_kv(cache, block_table, context_len, new, q.dtype).transpose(0, 1)[None]
        for cache, new in zip((k_cache, v_cache), new_kv or (None, None), strict=True)
    )  # [1, kv_heads, context_len, d]
    qh = q.transpose(0, 1)[None]  # [1, heads, query_len, d]
    if query_len == context_len:
        mask, causal = None, True
    else:
        prefix = context_len - query_len
        rows = torch.arange(query_len, device=q.device)[:, None] + prefix
        mask, causal = torch.arange(context_len, device=q.device)[None, :] <= rows, False
    out = F.scaled_dot_product_attention(
        qh,
        k,
        v,
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


@on_rotated_kv
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

    k, v = dequantize(gather(k_cache), q.dtype), dequantize(gather(v_cache), q.dtype)
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
