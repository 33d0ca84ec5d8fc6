"""The UCX data path: the decode worker reads a request's blocks straight out of the
prefill worker's KV cache into its own reserved blocks, with one-sided reads.

    prefill worker (sender)                    decode worker (receiver)
    CacheMemory(kv): the cache mapped into     CacheMemory(kv): its own cache, the
      UCX once (a host cache that               destination of reads
      ``allocate_kv`` made lies in shared
      memory UCX allocated)
    after the handshake, frame b"M":
      cache address, blocks, packed key   ->   RemoteCache: the key unpacked on this
                                               connection's endpoint; the peer's cache
                                               mapped into this process when UCX can
                                               (same host, shared memory), else read
                                               with UCX gets (RDMA across hosts,
                                               cuda_ipc between GPUs of one host)
    per message, frame b"K" + header           under the reservation's write lock:
      (checksum of the source blocks, read       ``read``: mapped, one memmove per layer,
       where they lie; no payload)                K/V and run of blocks, each hashed
                                                  while it is still in cache; else one
                                                  UCX get per layer, K/V and run, then
                                                  the checksum of the destination blocks

No gather, no staging, no scatter: the bytes cross once, from cache to cache. (One
exception: UCX gets from a tensor-parallel peer of another width land in a staging
buffer, since a slice of heads is contiguous only within a token's row, and are
copied into the heads' ranks from there: heads.py.) Why
reads and not writes: every write into the decode worker's blocks is one it made
itself, under the reservation's write lock, so once an abort or a lease expiry has
returned nothing lands in those blocks any more, whatever the sender does. The
price is on the prefill side: it keeps a request's blocks until the decode worker
has acked them.

A peer that dies mid-read: a mapped cache stays readable (the segment lives while
mapped) and what was read is checked against the checksum its header carried; a
UCX get fails ("peer lost"). What a bad payload costs: it has landed in the
reservation's blocks, which are never decoded (the request fails "checksum") and
are rewritten by their next owner.

The description in frame b"M" is trusted as to the cache's size: only a sender that
proved the cluster's KV secret gets to send one (UCX does not bound a mapped key).
"""

from __future__ import annotations

import atexit
import bisect
import ctypes
import json
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.kv_transfer.base import TransferError
from tandem.kv_transfer.heads import HeadMap
from tandem.kv_transfer.payload import (
    block_bytes,
    block_runs,
    checksum_blocks,
    copy_blocks,
    first_block,
    paired_runs,
)
from tandem.kv_transfer.ucx import ucp
from tandem.kv_transfer.ucx.runtime import get_runtime

log = logging.getLogger(__name__)
# How long one message's reads may take before they are given up ("timeout"); the
# connection is dropped then, since only its endpoint's end stops the reads (ucp.get).
READ_TIMEOUT_S = 30.0

# Host caches that ``allocate_kv`` made: start address -> (end, Memory). Guarded by _lock.
_lock = threading.Lock()
_allocations: dict[int, tuple[int, ucp.Memory]] = {}
_exiting = False


@atexit.register
def _at_exit() -> None:
    # ucxx's context may be gone by the time the last tensors are collected.
    global _exiting
    _exiting = True


class _Allocation:
    """Owns one UCX allocation; numpy (and so torch) keeps it alive through the arrays
    made from it, and it is unmapped when the last of them goes."""

    def __init__(self, memory: ucp.Memory, nbytes: int) -> None:
        self.memory = memory
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (memory.address, False),
            "version": 3,
        }

    def __del__(self) -> None:
        with _lock:
            _allocations.pop(self.memory.address, None)
        if not _exiting:
            self.memory.close()


def allocate_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache tensor. On the host its memory is allocated by UCX (shared
    memory where UCX can), so a decode worker on this host maps it and reads blocks
    with a plain copy; elsewhere ``torch.zeros``."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    memory = ucp.Memory.allocate(get_runtime().context, nbytes)
    with _lock:
        _allocations[memory.address] = (memory.address + memory.length, memory)
    flat = torch.from_numpy(np.asarray(_Allocation(memory, nbytes)))
    return flat.view(dtype).view(shape).zero_()


def exiting() -> bool:
    """Whether the interpreter is exiting (UCX may be gone: unmap nothing more)."""
    return _exiting


def _allocation_of(t: torch.Tensor) -> ucp.Memory | None:
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    with _lock:
        starts = sorted(_allocations)
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and end <= _allocations[starts[i]][0]:
            return _allocations[starts[i]][1]
    return None


class _Staging:
    """Host memory that UCX gets from a peer of another tensor-parallel width land in,
    before its heads are re-split (one connection's; it reads one message at a time):
    allocated on first use, grown to the largest message, freed with the connection."""

    def __init__(self) -> None:
        self._memory: ucp.Memory | None = None

    def get(self, nbytes: int) -> ucp.Memory:
        if self._memory is None or self._memory.length < nbytes:
            self.close()
            self._memory = ucp.Memory.allocate(get_runtime().context, nbytes)
        return self._memory

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The start of the buffer as a tensor (valid until the next ``get``)."""
        nbytes = math.prod(shape) * dtype.itemsize
        raw = (ctypes.c_uint8 * nbytes).from_address(self._memory.address)
        return torch.from_numpy(np.ctypeslib.as_array(raw)).view(dtype).view(shape)

    def close(self) -> None:
        if self._memory is not None and not _exiting:
            self._memory.close()
        self._memory = None


@dataclass(frozen=True)
class RemoteCache:
    """A peer's cache as this side reads it."""

    base: int  # its address in the peer's process
    total_blocks: int  # the blocks dim, null block included
    rkey: ucp.RemoteKey
    view: torch.Tensor | None  # the peer's cache mapped here, when UCX can map it
    staging: _Staging = field(default_factory=_Staging)  # gets from a peer of another width
    # Called when gets outlive their timeout (ucp.get): ends the connection, whose
    # endpoint failing ends them.
    on_stuck: Callable[[], None] | None = None

    @property
    def mapped(self) -> bool:
        return self.view is not None


class CacheMemory:
    """One KV cache as UCX sees it: mapped once, described to peers, read into."""

    def __init__(self, kv: torch.Tensor) -> None:
        if not kv.is_contiguous():
            raise ValueError("a KV cache read in place must be contiguous")
        rt = get_runtime()
        ucp.check_thread_mode(rt.worker)
        self.kv = kv
        self._worker = rt.worker
        self._memory = _allocation_of(kv)
        self._owned = self._memory is None
        if self._memory is None:
            self._memory = ucp.Memory.register(
                rt.context, kv.data_ptr(), kv.numel() * kv.element_size(), cuda=kv.is_cuda
            )
        self.block_bytes = block_bytes(kv)

    def describe(self, mailbox: dict | None = None) -> bytes:
        """What a reader needs (frame b"M"): where the cache lies and the key to it,
        and the connection's mailbox, if the sender offers one (mailbox.py)."""
        body = {
            "base": self.kv.data_ptr(),
            "nbytes": self.kv.numel() * self.kv.element_size(),
            "blocks": self.kv.shape[2],
            "rkey": self._memory.pack_rkey().hex(),
        }
        if mailbox is not None:
            body["mailbox"] = mailbox
        return json.dumps(body).encode()

    def add_remote(
        self,
        endpoint: int,
        description: bytes,
        map_peer: bool = True,
        heads: HeadMap | None = None,
        on_stuck: Callable[[], None] | None = None,
    ) -> RemoteCache:
        """A peer's cache from its ``describe()``, reached over ``endpoint`` (a ucp_ep_h);
        ValueError when the description is malformed. ``map_peer`` False: read with UCX
        gets even where the peer's cache could be mapped (tests, the benchmark).
        ``heads``: the peer is of another tensor-parallel width (its cache's shape).
        ``on_stuck``: ends the connection when its gets outlive their timeout."""
        try:
            body = json.loads(description)
            base, blocks, packed = int(body["base"]), body["blocks"], bytes.fromhex(body["rkey"])
            nbytes = int(body["nbytes"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"bad cache description: {exc!r}") from None
        if not isinstance(blocks, int) or blocks < 2:
            raise ValueError(f"bad cache description: {blocks!r} blocks")
        # The cache the handshake's fingerprint describes, as this side will read it.
        shape = (self.kv.shape[0], 2, blocks, *self.kv.shape[3:])
        if heads is not None:
            block_size, _, row = self.kv.shape[3:]
            shape = (heads.src_layers, 2, blocks, block_size, heads.src_heads, row)
        if math.prod(shape) * self.kv.element_size() != nbytes:
            raise ValueError(
                f"bad cache description: {nbytes} bytes, not the {list(shape)} "
                "its fingerprint and block count say"
            )
        try:
            rkey = ucp.RemoteKey(endpoint, packed)
        except ucp.UcpError as exc:
            raise ValueError(f"bad cache description: {exc}") from None
        view, pointer = None, None
        if map_peer and not self.kv.is_cuda:
            pointer, why = rkey.pointer(base)
            if pointer is None:
                log.info("the sender's KV cache cannot be mapped here (%s): UCX gets", why)
        if pointer is not None:
            raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(pointer))
            view = torch.from_numpy(raw).view(self.kv.dtype).view(shape)
        return RemoteCache(base, blocks, rkey, view, on_stuck=on_stuck)

    def remove_remote(self, remote: RemoteCache) -> None:
        """The connection that added ``remote`` ended and its reads are over."""
        remote.rkey.close()
        remote.staging.close()

    def read(
        self,
        remote: RemoteCache,
        src_block_ids: tuple[int, ...],
        dst_block_ids: tuple[int, ...],
        layers: tuple[int, int],
        heads: HeadMap | None = None,
        timeout_s: float = READ_TIMEOUT_S,
    ) -> int | None:
        """Copy the peer's ``src_block_ids`` of ``layers`` into this cache's
        ``dst_block_ids``; returns once they have landed, else TransferError.

        From a mapped cache ``payload.copy_blocks`` copies them and returns the checksum
        of what landed; after UCX gets, None (the caller checksums the blocks).
        ``heads``: a peer of another width, whose heads are re-split (heads.py): a
        strided copy from a mapped cache, else from a staging buffer that one UCX get
        per layer, K/V and run filled (one get per token row and slice of heads
        instead cost 45x more in ``python bench/tp_transfer.py``); the checksum of
        the sender's bytes as they reached this side is returned."""
        bad = [b for b in src_block_ids if b >= remote.total_blocks - 1]
        if bad:
            raise TransferError("bad header", f"source block ids {bad} outside the sender's pool")
        if heads is not None:
            if remote.view is not None:
                src = remote.view[layers[0] : layers[1]]
            else:
                src = self._stage(remote, src_block_ids, layers, heads.src_heads, timeout_s)
                src_block_ids = tuple(range(len(src_block_ids)))  # in request order there
            heads.copy(self.kv, src, src_block_ids, dst_block_ids, layers)
            return checksum_blocks(src, src_block_ids, (0, layers[1] - layers[0]))
        if remote.view is not None:
            return copy_blocks(
                self.kv,
                remote.view.data_ptr(),
                remote.total_blocks,
                src_block_ids,
                dst_block_ids,
                layers,
            )
        here, local_blocks = self.kv.data_ptr(), self.kv.shape[2]
        reads = [
            (
                here + self._offset(local_blocks, layer, k_or_v, dst),
                remote.base + self._offset(remote.total_blocks, layer, k_or_v, src),
                n * self.block_bytes,
            )
            for layer in range(*layers)
            for k_or_v in (0, 1)
            for src, dst, n in paired_runs(src_block_ids, dst_block_ids)
        ]
        self._get(remote, reads, self._memory, timeout_s)
        return None

    def _stage(
        self,
        remote: RemoteCache,
        src_block_ids: tuple[int, ...],
        layers: tuple[int, int],
        heads: int,
        timeout_s: float,
    ) -> torch.Tensor:
        """The peer's ``src_block_ids`` of ``layers`` (``heads`` KV heads a row), read
        into ``remote``'s staging buffer, [layers, 2, blocks in request order, ...]."""
        block_size, _, row = self.kv.shape[3:]
        shape = (layers[1] - layers[0], 2, len(src_block_ids), block_size, heads, row)
        block = block_size * heads * row * self.kv.element_size()
        staging = remote.staging.get(math.prod(shape) * self.kv.element_size())
        here, reads, at = staging.address, [], 0
        for layer in range(*layers):
            for k_or_v in (0, 1):
                base = first_block(remote.total_blocks, layer, k_or_v)
                for first, n in block_runs(src_block_ids):
                    reads.append((here + at, remote.base + (base + first) * block, n * block))
                    at += n * block
        self._get(remote, reads, staging, timeout_s)
        return remote.staging.tensor(shape, self.kv.dtype)

    def _get(
        self,
        remote: RemoteCache,
        reads: list[tuple[int, int, int]],
        local: ucp.Memory,
        timeout_s: float,
    ) -> None:
        try:
            ucp.get(self._worker, remote.rkey, reads, local, timeout_s, remote.on_stuck)
        except ucp.UcpError as exc:
            raise TransferError("peer lost", f"UCX read: {exc}") from None
        except TimeoutError as exc:
            raise TransferError("timeout", str(exc)) from None

    def _offset(self, total_blocks: int, layer: int, k_or_v: int, block: int) -> int:
        return (first_block(total_blocks, layer, k_or_v) + block) * self.block_bytes

    def close(self) -> None:
        if self._owned:
            self._memory.close()
