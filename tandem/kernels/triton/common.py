"""What the Triton launchers share: input checks, the interpreter switch, device facts.

``TRITON_INTERPRET=1`` is read by ``@triton.jit`` when a kernel module is imported,
not at launch: the kernels in this package are interpreted (numpy, on CPU tensors)
if and only if the variable was set before the first import of this package.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton
import triton.language as tl

# An int8 cache's rows: head_dim values, then their float16 scale as two bytes.
from tandem.kernels.torch_ref import INT8_SCALE_BYTES

try:  # newer Triton parses its environment in one place
    from triton import knobs

    _interpret = bool(knobs.runtime.interpret)
except ImportError:  # older Triton's jit compares the variable with "1"
    _interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Fixed at import, like the @triton.jit decorators of the kernel modules that import this.
INTERPRET: bool = _interpret

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The kernels' softmax runs in base 2 (exp2): scores are scaled by scale x log2(e).
LOG2E = 1.4426950408889634


@triton.jit
def mma(a, b, WIDEN: tl.constexpr):
    """``a @ b`` accumulated in float32; WIDEN (see ``widen``) does it in IEEE float32."""
    if WIDEN:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def row_scale(ptr, mask):
    """The float16 scales stored as two bytes (little-endian) at ``ptr``, as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint8, bitcast=True).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _int8_as(x, q, WIDEN: tl.constexpr):
    """int8 values in q's dtype (exact: |x| <= 127), or float32 where ``mma`` widens
    (the interpreter's int8 -> bfloat16 conversion is not to be trusted)."""
    if WIDEN:
        out = x.to(tl.float32)
    else:
        out = x.to(q.dtype)
    return out


@triton.jit
def _softmax_step(m, lsum, s):
    """The online softmax's update for a tile of base-2 scores ``s``: (the new row
    maxima, the new row sums, the tile's probabilities, the factor for the old sums)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, lsum * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def attend_tile(
    q,
    m,
    lsum,
    acc,
    n0,
    q_pos,
    context_len,
    table_ptr,
    k_ptr,
    v_ptr,
    kv_head,
    scale_log2,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    WIDEN: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One key tile's step of the online softmax (base 2) over K/V read through a block table.

    Keys at ``n0 .. n0 + BLOCK_N`` of the sequence whose block table is ``table_ptr``;
    CAUSAL masks, for each query row, the keys past ``q_pos`` and past ``context_len``
    (without it every key of the tile must be valid). QUANT: the cache is int8 with a
    scale per row, applied to the scores and to the probabilities (the int8 values
    are exact in q's dtype). Returns the new (m, lsum, acc).
    """
    pos = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    in_context = pos < context_len
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_context, other=0).to(tl.int64)
    token = (pos % BLOCK_SIZE).to(tl.int64)
    kv_mask = in_context[:, None] & (d[None, :] < HEAD_DIM)
    k_rows = k_ptr + block * stride_kb + token * stride_kt + kv_head * stride_kh  # [BLOCK_N]
    k = tl.load(k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if QUANT:
        k_scale = row_scale(k_rows + HEAD_DIM, in_context) * scale_log2
        s = mma(q, tl.trans(_int8_as(k, q, WIDEN)), WIDEN) * k_scale[None, :]
    else:
        s = mma(q, tl.trans(k), WIDEN) * scale_log2  # [BLOCK_M, BLOCK_N]
    if CAUSAL:
        visible = (pos[None, :] <= q_pos[:, None]) & in_context[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new, lsum, p, alpha = _softmax_step(m, lsum, s)
    v_rows = v_ptr + block * stride_vb + token * stride_vt + kv_head * stride_vh
    v = tl.load(v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if QUANT:
        p = p * row_scale(v_rows + HEAD_DIM, in_context)[None, :]
        v = _int8_as(v, q, WIDEN)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, WIDEN)
    return m_new, lsum, acc


@triton.jit
def attend_new_tile(
    q,
    m,
    lsum,
    acc,
    j0,
    rows,
    query_len,
    k_ptr,
    v_ptr,
    kv_head,
    scale_log2,
    stride_t,
    stride_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """``attend_tile`` over keys ``j0 .. j0 + BLOCK_N`` of the new tokens' own K/V as
    computed: dense [query_len, kv_heads, head_dim] tensors of q's dtype, both with
    strides ``stride_t`` and ``stride_h``. New key j is visible to query row r
    where j <= r."""
    j = j0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    valid = j < query_len
    kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
    offsets = j[:, None].to(tl.int64) * stride_t + kv_head * stride_h + d[None, :]
    k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0)
    s = mma(q, tl.trans(k), WIDEN) * scale_log2  # [BLOCK_M, BLOCK_N]
    s = tl.where((j[None, :] <= rows[:, None]) & valid[None, :], s, float("-inf"))
    m_new, lsum, p, alpha = _softmax_step(m, lsum, s)
    v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, WIDEN)
    return m_new, lsum, acc


def widen(dtype: torch.dtype) -> bool:
    """Whether ``mma`` must widen its inputs to float32 and use IEEE products.

    float32: tf32 products would miss the reference by ~1e-3. Under the interpreter:
    ``tl.dot`` on bfloat16 returns garbage in Triton 3.9; bf16 x bf16 products are
    exact in float32, so widening gives what a bf16 tensor-core dot with float32
    accumulation gives.
    """
    return dtype == torch.float32 or INTERPRET


def check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"the triton backend runs on CUDA tensors, got {device} "
            "(set TRITON_INTERPRET=1 before importing it to run the kernels on CPU)"
        )


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """[num_blocks, block_size, kv_heads, head_dim] each (int8: head_dim + 2), same shape
    and dtype, dim stride 1."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (*DTYPES, torch.int8):
        raise ValueError(
            f"k_cache and v_cache must share a dtype in {(*DTYPES, torch.int8)}, "
            f"got {k_cache.dtype} and {v_cache.dtype}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous along head_dim")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def head_dim_of(cache: torch.Tensor) -> int:
    return cache.shape[-1] - (INT8_SCALE_BYTES if is_quantized(cache) else 0)


def check_query(q: torch.Tensor, k_cache: torch.Tensor, name: str = "q") -> int:
    """[tokens, num_heads, head_dim] matching the cache; returns the GQA group size."""
    head_dim = head_dim_of(k_cache)
    if q.dim() != 3 or q.shape[-1] != head_dim:
        raise ValueError(f"{name} must be [tokens, num_heads, {head_dim}], got {tuple(q.shape)}")
    if is_quantized(k_cache):
        if q.dtype not in DTYPES:
            raise ValueError(f"{name} dtype {q.dtype} is not one of {DTYPES}")
    elif q.dtype != k_cache.dtype:
        raise ValueError(f"{name} dtype {q.dtype} differs from the cache dtype {k_cache.dtype}")
    if q.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along head_dim")
    kv_heads = k_cache.shape[2]
    if q.shape[1] % kv_heads:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of kv_heads {kv_heads}")
    return q.shape[1] // kv_heads


def check_index(t: torch.Tensor, name: str, dims: int) -> None:
    if t.dim() != dims or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a {dims}-d int32/int64 tensor, got {t.dtype} {t.shape}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dim")


def block_d(head_dim: int) -> int:
    # tl.dot needs every dim >= 16; masked lanes past head_dim load zeros.
    return max(16, triton.next_power_of_2(head_dim))


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on ``device`` (what Triton checks a
    compiled kernel against when it loads it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def on_its_device(launcher):
    """Run ``launcher`` with the calling thread's current CUDA device set to that of its
    first argument. Triton launches on the current device, not on its tensors', and
    that is set per thread: the engine steps on a thread of its own, so a worker on
    cuda:1 would launch every kernel on cuda:0."""

    name = next(iter(inspect.signature(launcher).parameters))

    @functools.wraps(launcher)
    def launch(*args, **kwargs):
        first = args[0] if args else kwargs[name]
        if not first.is_cuda:
            return launcher(*args, **kwargs)
        with torch.cuda.device(first.device):
            return launcher(*args, **kwargs)

    return launch
