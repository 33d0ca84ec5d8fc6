"""The CPU attention backend: the interface of :mod:`tandem.kernels.torch_ref`.

Decode attention is a C kernel (``paged_decode.c``) that reads the paged cache in
place through the block tables, compiled for this machine on first use
(``build.py``); the KV store and prefill attention are the torch reference's
(PyTorch's fused CPU attention already serves long queries well). Against the
torch backend's decode attention it was 1.6-3x faster on the default model's
shapes, in bfloat16 and float32 (``bench/decode_attention.py``).

``load`` must succeed before ``decode_attention`` is called; ``resolve_backend``
does that, and picks this backend for ``auto`` on a CPU where it loads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.kernels.cpu.build import load as _load_library
from tandem.kernels.torch_ref import decode_attention as _torch_decode_attention
from tandem.kernels.torch_ref import prefill_attention, store_kv

__all__ = ["decode_attention", "load", "prefill_attention", "store_kv"]

MAX_GROUP, MAX_DIM = 16, 256  # as in paged_decode.c
_SYMBOLS = {
    torch.bfloat16: "tandem_decode_attention_bf16",
    torch.float16: "tandem_decode_attention_f16",
    torch.float32: "tandem_decode_attention_f32",
}
_kernels: dict[torch.dtype, Callable[..., int]] = {}


def load(cache_dir: Path | None = None) -> bool:
    """Build (once per machine) and load the kernels; False where they cannot be."""
    if _kernels:
        return True
    lib = _load_library(cache_dir)
    if lib is None:
        return False
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for dtype, symbol in _SYMBOLS.items():
        fn = getattr(lib, symbol)
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64]
        fn.argtypes += [ctypes.c_float, ptr, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
        _kernels[dtype] = fn
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
    built for (a query group over 16 heads, head_dim over 256) take the reference."""
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    kernel = _kernels.get(q.dtype)
    if (
        kernel is None
        or q.device.type != "cpu"
        or num_heads // kv_heads > MAX_GROUP
        or head_dim > MAX_DIM
        or k_cache.dtype != q.dtype
    ):
        return _torch_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale
        )
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
