"""The CPU attention backend: the interface of :mod:`tandem.kernels.torch_ref`.

Decode attention is a C kernel (``paged_decode.c``) that reads the paged cache in
place through the block tables, compiled for this machine on first use
(``build.py``); prefill attention is the torch reference's (PyTorch's fused CPU
attention already serves long queries well). The KV store is C code too: into a
float cache of K's dtype, a copy of each token's rows (``step_ops.c``); into an int8
cache, each row rotated and quantized in one pass (the reference's values bit for
bit), which the decode kernel reads directly. Against the torch backend's decode
attention the kernel was 1.6-3x faster on the default model's shapes, in bfloat16
and float32 (``bench/decode_attention.py``).

``load`` must succeed before ``decode_attention`` is called; ``resolve_backend``
does that, and picks this backend for ``auto`` on a CPU where it loads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.kernels.cpu import build as _build
from tandem.kernels.cpu.build import load as _load_library
from tandem.kernels.torch_ref import decode_attention as _torch_decode_attention
from tandem.kernels.torch_ref import prefill_attention
from tandem.kernels.torch_ref import store_kv as _torch_store_kv

__all__ = ["decode_attention", "load", "prefill_attention", "store_kv"]

MAX_GROUP, MAX_DIM = 16, 256  # as in paged_decode.c
# (q dtype, cache dtype) -> symbol: a float cache in q's dtype, or an int8 one.
_SYMBOLS = {
    (torch.bfloat16, torch.bfloat16): "tandem_decode_attention_bf16",
    (torch.float16, torch.float16): "tandem_decode_attention_f16",
    (torch.float32, torch.float32): "tandem_decode_attention_f32",
    (torch.bfloat16, torch.int8): "tandem_decode_attention_bf16_i8",
    (torch.float16, torch.int8): "tandem_decode_attention_f16_i8",
    (torch.float32, torch.int8): "tandem_decode_attention_f32_i8",
}
_kernels: dict[tuple[torch.dtype, torch.dtype], Callable[..., int]] = {}
# The KV dtype -> the store into an int8 cache (rotate and quantize each row).
_STORE_SYMBOLS = {
    torch.bfloat16: "tandem_store_kv_i8_bf16",
    torch.float16: "tandem_store_kv_i8_f16",
    torch.float32: "tandem_store_kv_i8_f32",
}
_stores: dict[torch.dtype, Callable[..., int]] = {}
# k, its token stride, v, its token stride, the caches, the slots, tokens, capacity,
# bytes a token: step_ops.c's tandem_store_rows.
_STORE_ROWS_ARGS = (
    [ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
)


def load(cache_dir: Path | None = None) -> bool:
    """Build (once per machine) and load the kernels; False where they cannot be."""
    if _kernels:
        return True
    lib = _load_library(cache_dir)
    if lib is None:
        return False
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for dtypes, symbol in _SYMBOLS.items():
        fn = getattr(lib, symbol)
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64]
        fn.argtypes += [ctypes.c_float, ptr, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
        _kernels[dtypes] = fn
    for dtype, symbol in _STORE_SYMBOLS.items():
        fn = getattr(lib, symbol)
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
        _stores[dtype] = fn
    return True


def store_kv(
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim (+ 2 for int8)]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [tokens], int64
) -> None:
    """As :func:`tandem.kernels.torch_ref.store_kv`: into an int8 cache by the C store
    (bit-identical rows, one pass), into a float cache of k's dtype by a C copy of
    each token's rows (one call for K and V), else by the reference's copy."""
    if _store_rows(k, v, k_cache, v_cache, slot_mapping):
        return
    store = _stores.get(k.dtype)
    tokens, kv_heads, head_dim = k.shape
    if (
        k_cache.dtype != torch.int8
        or store is None
        or head_dim > MAX_DIM
        or k.stride(-1) != 1
        or v.stride(-1) != 1
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return _torch_store_kv(k, v, k_cache, v_cache, slot_mapping)
    # The kernel trusts every shape it is given.
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"store_kv: v {tuple(v.shape)} {v.dtype} is not k's")
    if v_cache.shape != k_cache.shape or k_cache.shape[2:] != (kv_heads, head_dim + 2):
        raise ValueError(
            f"store_kv: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not hold "
            f"{kv_heads} heads of {head_dim} int8 values and a scale"
        )
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"store_kv: {tuple(slot_mapping.shape)} slots for {tokens} tokens")
    slots = slot_mapping.to(torch.int64).contiguous()
    capacity = k_cache.shape[0] * k_cache.shape[1]
    # The kernel trusts the slots, as it must not write past the cache.
    if slots.numel() and not 0 <= int(slots.min()) <= int(slots.max()) < capacity:
        raise ValueError(f"store_kv: a slot outside the cache's {capacity}")
    status = store(
        k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), tokens,
        kv_heads, head_dim, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"store_kv: the CPU kernel refused the shapes (status {status})")


def _store_rows(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Copy K and V into a cache of their dtype with ``step_ops.c``; False (nothing
    written) where it does not apply: a layout whose heads do not lie one after
    another in each token's row, or no library here."""
    tokens, kv_heads, head_dim = k.shape
    rows = (kv_heads, head_dim)
    if not (
        all(t.device.type == "cpu" for t in (k, v, k_cache, v_cache, slot_mapping))
        and v.shape == k.shape
        and v.dtype == k.dtype
        and k_cache.dtype == v_cache.dtype == k.dtype
        and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (k, v))
        and k_cache.shape == v_cache.shape
        and k_cache.shape[2:] == rows
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and slot_mapping.dtype == torch.int64
        and slot_mapping.shape == (tokens,)
        and slot_mapping.is_contiguous()
    ):
        return False
    copy = _build.function("tandem_store_rows", _STORE_ROWS_ARGS)
    if copy is None:
        return False
    size = k.element_size()
    status = copy(
        k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size,
        k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), tokens,
        k_cache.shape[0] * k_cache.shape[1], kv_heads * head_dim * size,
    )  # fmt: skip
    if status != 0:  # the kernel checks the slots before it writes
        capacity = k_cache.shape[0] * k_cache.shape[1]
        raise IndexError(f"store_kv: a slot outside the cache's {capacity}")
    return True


def decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks], int64
    context_lens: torch.Tensor,  # [batch], int64, includes the new token
    max_context_len: int,
    scale: float,
) -> torch.Tensor:
    """As :func:`tandem.kernels.torch_ref.decode_attention`; shapes the kernel was not
    built for (a query group over 16 heads, head_dim over 256 or not a multiple of 8)
    take the reference."""
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    kernel = _kernels.get((q.dtype, k_cache.dtype))
    if (
        kernel is None
        or q.device.type != "cpu"
        or num_heads // kv_heads > MAX_GROUP
        or head_dim > MAX_DIM
        or head_dim % 8
    ):
        return _torch_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale
        )
    # An int8 cache's rows are rotated: the kernel rotates q and the output itself.
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()  # rows may be strided (q is a slice of the fused projection)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode_attention: the K and V caches must be contiguous")
    # The kernel trusts the tables; a table too short for its context would be read past.
    if block_tables.shape[1] * block_size < max_context_len:
        raise ValueError(
            f"decode_attention: block tables of {block_tables.shape[1]} blocks cannot hold "
            f"a context of {max_context_len} tokens"
        )
    block_tables = block_tables.to(torch.int64).contiguous()
    context_lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype)
    status = kernel(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        context_lens.data_ptr(),
        batch,
        num_heads,
        kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError(f"decode_attention: the CPU kernel failed (status {status})")
    return out
