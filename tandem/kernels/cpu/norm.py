"""RMSNorm of bfloat16 rows on a CPU, the residual add before it fused in
(``rms_norm.c``, in the CPU kernels' library): one call where torch's ops take 8-10.

``rms_norm`` returns None where the kernel does not apply (another dtype or device,
or no library here), and the caller computes with torch's ops instead: float32
models (Hugging Face parity) always do.
"""

from __future__ import annotations

import ctypes

import torch

from tandem.kernels.cpu import build

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
_ARGS = [_ptr, _ptr, _ptr, _ptr, ctypes.c_float, _ptr, _i64, _i64, ctypes.c_int]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(h, weight * rms_norm(h)) with h = x + residual (x without one), bfloat16, or None
    where the kernel does not apply."""
    if (
        x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or x.dim() != 2
        or weight.shape != (x.shape[1],)
        or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))
    ):
        return None
    kernel = build.function("tandem_rms_norm_bf16", _ARGS)
    if kernel is None:
        return None
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty_like(x)
    h = x
    if residual is not None:
        residual = residual.contiguous()
        h = torch.empty_like(x)
    status = kernel(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        None if residual is None else h.data_ptr(),
        weight.data_ptr(),
        eps,
        y.data_ptr(),
        x.shape[0],
        x.shape[1],
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"rms_norm: the CPU kernel refused {tuple(x.shape)} (status {status})")
    return h, y
