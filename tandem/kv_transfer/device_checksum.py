"""The checksum of KV blocks that lie on a GPU, computed there: no byte goes to the host.

A host cache is hashed with xxh3_64 where it lies, a digest per layer (payload.py).
That is CPU work, so for a GPU cache every run of blocks used to be copied to the
host first, on both sides of a transfer: every KV byte crossed PCIe
twice more than the transfer itself. This checksum is one pass of a GPU kernel
over the blocks where they lie, and one 8-byte result.

The algorithm ("fmix64-sum"): the blocks are read as 16-bit words in the message's
logical order (layer, then K and V, then the blocks in request order, as the host
checksum). Word ``w`` at logical index ``i`` contributes ``fmix64(w | i << 16)``
(MurmurHash3's 64-bit finalizer, a bijection); the checksum is the sum of all
contributions modulo 2**64. It depends on the bytes and their logical order only,
not on where the blocks lie, so a sender's source blocks and a receiver's
destination blocks give the same value exactly when their bytes match in order;
any one changed word changes the sum (the finalizer is a bijection), and several
cancel only by chance (about 2**-64). Like xxh3 it guards against corruption and
bugs, not an adversary: connections are authenticated for that (auth.py).

Both sides must use the same algorithm: ``algorithm_for(device)`` names it, and
it is part of the KV fingerprint, so a host-cache worker and a GPU-cache worker
refuse each other at connect time by name instead of failing every transfer.

The Triton kernel runs where triton is (CUDA; CPU under ``TRITON_INTERPRET=1`` for
tests); ``checksum_torch`` computes the same value with plain tensor ops on any
device (the reference, and the fallback without triton).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from tandem.kv_transfer.base import HOST_CHECKSUM
from tandem.kv_transfer.payload import block_bytes, first_block

DEVICE_CHECKSUM = "fmix64-sum"
_MASK64 = (1 << 64) - 1
# fmix64's multipliers as the signed 64-bit integers torch and triton compute with.
_C1 = 0xFF51AFD7ED558CCD - (1 << 64)
_C2 = 0xC4CEB9FE1A85EC53 - (1 << 64)
_CHUNK = 1024  # words per kernel program


def algorithm_for(device: torch.device | str) -> str:
    """The checksum a KV cache on ``device`` is verified with."""
    return DEVICE_CHECKSUM if torch.device(device).type == "cuda" else HOST_CHECKSUM


def segments(
    kv: torch.Tensor, block_ids: tuple[int, ...] | list[int], layers: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each block of the message, in logical order: its first word in ``kv`` (int64,
    on ``kv``'s device), its first logical word index, and the words per block."""
    nbytes = block_bytes(kv)
    if nbytes % 2:
        raise ValueError(f"a KV block of {nbytes} bytes is not a whole number of 16-bit words")
    words = nbytes // 2
    total = kv.shape[2]
    starts = [
        (first_block(total, layer, k_or_v) + block) * words
        for layer in range(*layers)
        for k_or_v in (0, 1)
        for block in block_ids
    ]
    physical = torch.tensor(starts, dtype=torch.int64, device=kv.device)
    logical = torch.arange(len(starts), dtype=torch.int64, device=kv.device) * words
    return physical, logical, words


def _words(kv: torch.Tensor) -> torch.Tensor:
    if not kv.is_contiguous():
        raise ValueError("the device checksum reads a contiguous KV cache")
    return kv.view(-1).view(torch.int16)


def _fmix64(x: torch.Tensor) -> torch.Tensor:
    # Logical right shifts of int64: an arithmetic shift by 33 then the top bits masked.
    x = x ^ ((x >> 33) & 0x7FFFFFFF)
    x = x * _C1
    x = x ^ ((x >> 33) & 0x7FFFFFFF)
    x = x * _C2
    return x ^ ((x >> 33) & 0x7FFFFFFF)


def checksum_torch(
    kv: torch.Tensor, block_ids: tuple[int, ...] | list[int], layers: tuple[int, int]
) -> int:
    """The checksum with tensor ops, on ``kv``'s device (int64 arithmetic wraps)."""
    physical, logical, words = segments(kv, block_ids, layers)
    offsets = torch.arange(words, dtype=torch.int64, device=kv.device)
    flat = _words(kv)
    total = torch.zeros((), dtype=torch.int64, device=kv.device)
    for p, lg in zip(physical.split(256), logical.split(256), strict=True):  # bounded memory
        w = flat[p[:, None] + offsets].to(torch.int64) & 0xFFFF
        total += _fmix64(w | ((lg[:, None] + offsets) << 16)).sum()
    return int(total.item()) & _MASK64


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fmix64_sum_kernel(
        words,
        physical,
        logical,
        partials,
        n_words,
        CHUNK: tl.constexpr,
        C1: tl.constexpr,  # a kernel reads no global that is not a constexpr
        C2: tl.constexpr,
    ):
        seg = tl.program_id(0)
        chunk = tl.program_id(1)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        live = offs < n_words
        start = tl.load(physical + seg)
        w = tl.load(words + start + offs, mask=live, other=0)
        x = w.to(tl.uint16, bitcast=True).to(tl.uint64)
        index = (tl.load(logical + seg) + offs).to(tl.uint64)
        x = x | (index << 16)
        c1 = tl.full([CHUNK], C1, tl.int64).to(tl.uint64, bitcast=True)
        c2 = tl.full([CHUNK], C2, tl.int64).to(tl.uint64, bitcast=True)
        x = x ^ (x >> 33)
        x = x * c1
        x = x ^ (x >> 33)
        x = x * c2
        x = x ^ (x >> 33)
        x = tl.where(live, x, tl.zeros([CHUNK], tl.uint64))
        total = tl.sum(x, axis=0)
        tl.store(partials + seg * tl.num_programs(1) + chunk, total.to(tl.int64, bitcast=True))

    return fmix64_sum_kernel


def checksum_triton(
    kv: torch.Tensor, block_ids: tuple[int, ...] | list[int], layers: tuple[int, int]
) -> int:
    """The checksum with one Triton kernel launch over every block of the message."""
    physical, logical, words = segments(kv, block_ids, layers)
    chunks = -(-words // _CHUNK)
    partials = torch.empty(len(physical) * chunks, dtype=torch.int64, device=kv.device)
    if len(physical):
        grid = (len(physical), chunks)
        # Triton launches on the calling thread's current device (a transfer thread's).
        with torch.cuda.device(kv.device) if kv.is_cuda else contextlib.nullcontext():
            _kernel()[grid](
                _words(kv), physical, logical, partials, words, CHUNK=_CHUNK, C1=_C1, C2=_C2
            )
    return int(partials.sum().item()) & _MASK64


def checksum(
    kv: torch.Tensor, block_ids: tuple[int, ...] | list[int], layers: tuple[int, int]
) -> int:
    """The device checksum of ``block_ids`` of ``layers``: Triton where it runs, else
    tensor ops; the same value either way."""
    from tandem.kernels import triton_installed

    if kv.is_cuda and triton_installed():
        return checksum_triton(kv, block_ids, layers)
    return checksum_torch(kv, block_ids, layers)
