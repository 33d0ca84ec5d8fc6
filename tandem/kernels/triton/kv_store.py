"""KV store: write each new token's K and V into its slot of the paged cache.

One program per token copies all of the token's KV heads for K and for V; the
slot ``block_id * block_size + offset`` comes from ``slot_mapping``, so a decode
step (one token per sequence) and a whole prompt are the same launch. An int8
cache gets each row rotated and quantized as ``torch_ref.store_kv`` does it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.torch_ref import rotate
from tandem.kernels.triton.common import (
    block_d,
    check_cache,
    check_device,
    check_index,
    head_dim_of,
    is_quantized,
    on_its_device,
)


@triton.jit
def _store_rows(cache_ptr, rows, x, h_mask, d, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """``x`` [BLOCK_H, BLOCK_D] into the cache rows starting at ``cache_ptr + rows``;
    QUANT: as int8 values and their float16 scale (absmax / 127) in the two bytes
    after them."""
    mask = h_mask[:, None] & (d[None, :] < HEAD_DIM)
    dst = cache_ptr + rows[:, None] + d[None, :]
    if QUANT:
        x = x.to(tl.float32)
        absmax = tl.max(tl.where(mask, tl.abs(x), 0.0), 1)
        # div_rn: IEEE division as torch's (a GPU's "/" is approximate).
        scale = tl.minimum(tl.math.div_rn(absmax, 127.0), 65504.0).to(tl.float16)
        s = scale.to(tl.float32)[:, None]
        q = tl.where(s > 0, tl.math.div_rn(x, tl.where(s > 0, s, 1.0)), 0.0)
        q = tl.minimum(tl.maximum(tl.floor(q + 0.5), -127.0), 127.0)
        tl.store(dst, q.to(tl.int8), mask=mask)
        bits = scale.to(tl.uint16, bitcast=True)
        lo = (bits & 0xFF).to(tl.uint8).to(tl.int8, bitcast=True)
        hi = (bits >> 8).to(tl.uint8).to(tl.int8, bitcast=True)
        tl.store(cache_ptr + rows + HEAD_DIM, lo, mask=h_mask)
        tl.store(cache_ptr + rows + HEAD_DIM + 1, hi, mask=h_mask)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides: block, token, head (head_dim is contiguous)
    stride_ct,
    stride_ch,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = h < KV_HEADS
    mask = h_mask[:, None] & (d[None, :] < HEAD_DIM)
    rows = block * stride_cb + offset * stride_ct + h * stride_ch
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    _store_rows(k_cache_ptr, rows, k, h_mask, d, HEAD_DIM, QUANT)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    _store_rows(v_cache_ptr, rows, v, h_mask, d, HEAD_DIM, QUANT)


@on_its_device
def store_kv(
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens], int64
) -> None:
    """Write each token's K/V into its slot of the paged cache (cast to the cache dtype)."""
    check_cache(k_cache, v_cache)
    check_device(k, v, k_cache, v_cache, slot_mapping)
    check_index(slot_mapping, "slot_mapping", 1)
    _, block_size, kv_heads, _ = k_cache.shape
    head_dim = head_dim_of(k_cache)
    tokens = slot_mapping.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.shape != (tokens, kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [{tokens}, {kv_heads}, {head_dim}] "
                f"(tokens from slot_mapping, heads from the cache), got {tuple(t.shape)}"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    if tokens == 0:
        return
    if is_quantized(k_cache):  # the kernel quantizes rows rotated here (torch_ref.rotate)
        k, v = rotate(k.float()), rotate(v.float())
    _store_kv_kernel[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=block_d(head_dim),
        QUANT=is_quantized(k_cache),
        num_warps=1 if kv_heads * head_dim <= 512 else 4,
    )
