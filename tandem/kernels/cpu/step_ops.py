"""Small steps of a decode step on a CPU, each one call into ``step_ops.c`` (in the
CPU kernels' library) with torch's result bit for bit:

- ``rope``: RoPE of bfloat16 heads, where torch takes four dispatches (a roll, two
  products and their sum; ``tandem.engine.rope.apply_rope``);
- ``argmax``: each float32 row's first maximum (the greedy token), which torch's
  ``max(dim=-1)`` finds several times slower over a 49,152-token vocabulary.

Each returns None where its kernel does not apply (another dtype or device, a
layout it does not read, or no library here), and the caller uses torch's ops
instead: float32 models (Hugging Face parity) always rotate with torch's.
"""

from __future__ import annotations

import ctypes

import torch

from tandem.kernels.cpu import build

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
_ROPE_ARGS = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64]
_ARGMAX_ARGS = [_ptr, _i64, _i64, _i64, _ptr, ctypes.c_int]


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor | None:
    """``apply_rope(x, cos, sin_signed)`` for x [tokens, heads, head_dim] in bfloat16
    whose heads lie one after another in each token's row, or None."""
    if (
        x.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or cos.device.type != "cpu"
        or sin_signed.device.type != "cpu"
        or x.dim() != 3
        or x.stride(2) != 1
        or x.stride(1) != x.shape[2]
        or x.shape[2] % 2
        or cos.shape != (x.shape[0], x.shape[2])
        or sin_signed.shape != cos.shape
        or cos.dtype != x.dtype
        or sin_signed.dtype != x.dtype
    ):
        return None
    kernel = build.function("tandem_rope_bf16", _ROPE_ARGS)
    if kernel is None:
        return None
    cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    tokens, heads, dim = x.shape
    status = kernel(
        x.data_ptr(), x.stride(0), cos.data_ptr(), sin_signed.data_ptr(), out.data_ptr(),
        tokens, heads, dim,
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"rope: the CPU kernel refused {tuple(x.shape)} (status {status})")
    return out


def argmax(rows: torch.Tensor) -> list[int] | None:
    """``rows.max(dim=-1).indices.tolist()`` for float32 rows [n, vocab] on a CPU, or
    None."""
    if (
        rows.dtype != torch.float32
        or rows.device.type != "cpu"
        or rows.dim() != 2
        or rows.shape[1] < 1
        or rows.stride(1) != 1
    ):
        return None
    kernel = build.function("tandem_argmax_f32", _ARGMAX_ARGS)
    if kernel is None:
        return None
    out = (ctypes.c_int64 * rows.shape[0])()
    n, vocab = rows.shape
    # One row is not worth waking the other threads for.
    threads = torch.get_num_threads() if n > 1 else 1
    status = kernel(rows.data_ptr(), rows.stride(0), n, vocab, out, threads)
    if status != 0:
        raise ValueError(f"argmax: the CPU kernel refused {tuple(rows.shape)} (status {status})")
    return list(out)
