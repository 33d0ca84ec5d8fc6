"""A request's KV blocks as messages describe them: the header, and the checksum and
copy of blocks read where they lie.

A message moves one layer range of one request; no payload travels with it, the
receiver reads the blocks out of the sender's cache (ucx/rma.py; inproc.py in one
process):

    sender:   header = make_header(..., kv)        checksum_blocks of the source blocks
    receiver: decode_header(bytes) validates every field; check_fits against its cache
              copy_blocks (or UCX gets) into the reserved blocks, then the checksum
              of what landed is compared with header.checksum

A checksum is xxh3_64 over the digests of the message's layers, each the xxh3_64
of that layer's K and then V blocks in request order, whichever runs of
consecutive ids they lie in: the same digest on both sides exactly when the bytes
are the same, however many threads hashed which layers (hashing.py). A cache on a
GPU is checksummed there, in the same order (device_checksum.py). Source and
destination block ids may differ and need not be sorted: source block
``src_block_ids[i]`` lands in ``dst_block_ids[i]``. The null block (index
``num_blocks``) is never a valid source or destination.
"""

from __future__ import annotations

import ctypes
import json
import math
from dataclasses import dataclass

import torch
import xxhash

from tandem.kv_transfer import hashing

HEADER_MAGIC = "tkv1"
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,  # values and their scales (tandem/kernels/torch_ref.py)
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class HeaderError(ValueError):
    """A message header is malformed or does not fit the receiver's KV layout."""


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise HeaderError(f"unknown dtype {name!r}") from None


@dataclass(frozen=True)
class MessageHeader:
    """The blocks one message moves (``nbytes == 0``: none, the first token only)."""

    request_id: str
    layer_start: int
    layer_end: int  # exclusive; == layer_start for a final message that carries no KV
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]  # [layer_end - layer_start, 2, n, block_size, kv_heads, head_dim]
    nbytes: int
    checksum: int  # checksum_blocks of the source blocks
    first_token: int | None = None  # set on the final message
    final: bool = False  # the sender's last message for this request: ack it

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


def encode_header(h: MessageHeader) -> bytes:
    """Compact JSON: a header is small next to its payload and JSON is easy to debug."""
    body = [
        HEADER_MAGIC,
        h.request_id,
        h.layer_start,
        h.layer_end,
        list(h.src_block_ids),
        list(h.dst_block_ids),
        h.dtype,
        list(h.shape),
        h.nbytes,
        h.checksum,
        h.first_token,
        h.final,
    ]
    return json.dumps(body, separators=(",", ":")).encode()


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value
    ):
        raise HeaderError(f"{what} must be a list of non-negative integers")
    return tuple(value)


def decode_header(data: bytes | bytearray | memoryview) -> MessageHeader:
    """Parse and check a header's internal consistency (layout fit: ``check_fits``)."""
    try:
        body = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeaderError(f"header is not valid JSON: {exc}") from None
    if not isinstance(body, list) or len(body) != 12 or body[0] != HEADER_MAGIC:
        raise HeaderError("not a Tandem KV header (bad magic or field count)")
    _, rid, l0, l1, src, dst, dtype, shape, nbytes, checksum, first, final = body
    if not isinstance(rid, str) or not rid:
        raise HeaderError("request_id must be a non-empty string")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (l0, l1, nbytes, checksum)):
        raise HeaderError("layer range, nbytes and checksum must be integers")
    if not 0 <= l0 <= l1:
        raise HeaderError(f"bad layer range [{l0}, {l1})")
    if first is not None and not (isinstance(first, int) and not isinstance(first, bool)):
        raise HeaderError("first_token must be an integer or null")
    if not isinstance(final, bool):
        raise HeaderError("final must be a boolean")
    h = MessageHeader(
        request_id=rid,
        layer_start=l0,
        layer_end=l1,
        src_block_ids=_ints(src, "src_block_ids"),
        dst_block_ids=_ints(dst, "dst_block_ids"),
        dtype=dtype if isinstance(dtype, str) else "",
        shape=_ints(shape, "shape"),
        nbytes=nbytes,
        checksum=checksum,
        first_token=first,
        final=final,
    )
    if len(h.src_block_ids) != len(h.dst_block_ids):
        raise HeaderError(
            f"{len(h.src_block_ids)} source blocks but {len(h.dst_block_ids)} destination blocks"
        )
    if h.num_layers == 0:  # a final message that only carries the first token
        if h.nbytes != 0:
            raise HeaderError(f"nbytes {h.nbytes} for an empty layer range")
        return h
    elem = dtype_from_name(h.dtype).itemsize
    if len(h.shape) != 6 or h.shape[:3] != (h.num_layers, 2, len(h.dst_block_ids)):
        raise HeaderError(f"shape {list(h.shape)} does not match layers and block count")
    if h.nbytes != math.prod(h.shape) * elem:
        raise HeaderError(f"nbytes {h.nbytes} does not match shape {list(h.shape)}")
    return h


def check_fits(
    h: MessageHeader, kv: torch.Tensor, sender: tuple[int, int, int] | None = None
) -> None:
    """Raise HeaderError unless the header's payload fits ``kv`` (the receiver's tensor).

    ``sender``: a sender of another tensor-parallel width (heads.py), as (its layers,
    its layers per rank, its KV heads per rank); a message holds one rank's layers."""
    num_layers, _, total, *block_shape = kv.shape
    num_blocks = total - 1  # the last block is the null block
    if sender is not None:
        num_layers, per_rank, heads = sender
        block_shape = [block_shape[0], heads, block_shape[2]]
        if h.num_layers and h.layer_start // per_rank != (h.layer_end - 1) // per_rank:
            raise HeaderError(f"layer range [{h.layer_start}, {h.layer_end}) spans ranks")
    if h.layer_end > num_layers:
        raise HeaderError(f"layer range [{h.layer_start}, {h.layer_end}) past {num_layers} layers")
    if h.num_layers and h.dtype != dtype_name(kv.dtype):
        raise HeaderError(f"dtype {h.dtype}, receiver holds {dtype_name(kv.dtype)}")
    if h.num_layers and list(h.shape[3:]) != block_shape:
        raise HeaderError(f"block shape {list(h.shape[3:])}, receiver holds {block_shape}")
    bad = [b for b in h.dst_block_ids if b >= num_blocks]
    if bad:
        raise HeaderError(f"destination block ids {bad} outside the pool of {num_blocks}")
    if len(set(h.dst_block_ids)) != len(h.dst_block_ids):
        raise HeaderError("destination block ids repeat")


def as_bytes(t: torch.Tensor) -> memoryview:
    """A host tensor's bytes without a copy (what checksums read)."""
    return memoryview(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy())


def block_bytes(kv: torch.Tensor) -> int:
    """Bytes of one block of one layer's K (or V): the unit every run is measured in."""
    return math.prod(kv.shape[3:]) * kv.element_size()


def first_block(total_blocks: int, layer: int, k_or_v: int) -> int:
    """Where block 0 of ``layer``'s K (0) or V (1) lies, in blocks from the start of a
    contiguous cache of ``total_blocks`` per layer and K/V: the layout's one formula."""
    return (layer * 2 + k_or_v) * total_blocks


def block_runs(block_ids: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
    """(first block id, length) of each run of consecutive ids, in order, unbounded."""
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def paired_runs(
    src_block_ids: tuple[int, ...] | list[int], dst_block_ids: tuple[int, ...] | list[int]
) -> list[tuple[int, int, int]]:
    """(first source id, first destination id, length) of each stretch where both lists
    run on consecutively: one contiguous copy per layer, K or V, and stretch."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_block_ids, dst_block_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def checksum_blocks(
    kv: torch.Tensor, block_ids: tuple[int, ...] | list[int], layers: tuple[int, int]
) -> int:
    """The checksum of ``block_ids`` of ``layers``, read where they lie: xxh3_64 of the
    layers' digests, each layer's the xxh3_64 of its K then its V blocks in order, one
    contiguous run at a time (hashing.py; a large message's layers on several threads).

    The sender hashes its source blocks, the receiver its destination blocks, and
    the digests match exactly when the bytes do. A GPU cache is checksummed on the
    GPU instead, with another algorithm (device_checksum.py; the KV fingerprint
    names which).
    """
    if kv.is_cuda:
        from tandem.kv_transfer import device_checksum

        return device_checksum.checksum(kv, block_ids, layers)
    runs = block_runs(block_ids)
    if not kv.is_contiguous():  # not a cache the engine allocates: hashed from copies
        return hashing.combine(
            [
                xxhash.xxh3_64_intdigest(as_bytes(kv[layer][:, list(block_ids)].cpu()))
                for layer in range(*layers)
            ]
        )
    base, block, total = kv.data_ptr(), block_bytes(kv), kv.shape[2]

    def layer_bytes(layer: int, digest: hashing.Digest) -> None:
        for k_or_v in (0, 1):
            at = base + first_block(total, layer, k_or_v) * block
            for first, n in runs:
                digest.update(at + first * block, n * block)

    nbytes = 2 * len(block_ids) * block * (layers[1] - layers[0])
    digests = hashing.layer_digests(layer_bytes, range(*layers), nbytes, 2 * len(runs))
    return hashing.combine(digests)


def make_header(
    request_id: str,
    layers: tuple[int, int],
    src_block_ids: tuple[int, ...],
    dst_block_ids: tuple[int, ...],
    kv: torch.Tensor,
    first_token: int | None = None,
    final: bool = False,
) -> MessageHeader:
    """The header of the blocks ``src_block_ids`` of ``layers`` of ``kv`` as they lie;
    an empty layer range carries no KV."""
    if layers[0] == layers[1]:
        shape: tuple[int, ...] = ()
        nbytes, digest, dtype = 0, hashing.combine([]), ""
    else:
        shape = (layers[1] - layers[0], 2, len(src_block_ids), *kv.shape[3:])
        nbytes = math.prod(shape) * kv.element_size()
        digest = checksum_blocks(kv, src_block_ids, layers)
        dtype = dtype_name(kv.dtype)
    return MessageHeader(
        request_id=request_id,
        layer_start=layers[0],
        layer_end=layers[1],
        src_block_ids=tuple(src_block_ids),
        dst_block_ids=tuple(dst_block_ids),
        dtype=dtype,
        shape=shape,
        nbytes=nbytes,
        checksum=digest,
        first_token=first_token,
        final=final,
    )


def copy_blocks(
    dst: torch.Tensor,
    src_address: int,
    src_total_blocks: int,
    src_block_ids: tuple[int, ...],
    dst_block_ids: tuple[int, ...],
    layers: tuple[int, int],
) -> int:
    """Copy blocks of ``layers`` from a host cache of the same layout at ``src_address``
    (``src_total_blocks`` in its blocks dim: it may be another process's, mapped here)
    into host cache ``dst``; returns the checksum of what landed, as
    ``checksum_blocks`` of the destination gives it.

    One ``memmove`` per layer, K/V and run of consecutive ids on both sides, each run
    hashed right after it landed, while it is still in cache: the second pass over
    the bytes costs little. ``memmove`` releases the GIL, as xxhash does for a long
    run: a large message's layers are copied on several threads (hashing.py).
    """
    block = block_bytes(dst)
    here, dst_total = dst.data_ptr(), dst.shape[2]
    runs = paired_runs(src_block_ids, dst_block_ids)

    def copy_layer(layer: int, digest: hashing.Digest) -> None:
        for k_or_v in (0, 1):
            to_base = here + first_block(dst_total, layer, k_or_v) * block
            from_base = src_address + first_block(src_total_blocks, layer, k_or_v) * block
            for src, to, n in runs:
                ctypes.memmove(to_base + to * block, from_base + src * block, n * block)
                digest.update(to_base + to * block, n * block)

    nbytes = 2 * len(dst_block_ids) * block * (layers[1] - layers[0])
    digests = hashing.layer_digests(copy_layer, range(*layers), nbytes, 2 * len(runs))
    return hashing.combine(digests)
