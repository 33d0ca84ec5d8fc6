"""A second tier of KV blocks in host memory, behind the engine's cache.

Two kinds of blocks live here:
- prefix blocks: a cached block (full, hashed, free) that the device pool reuses
  for other data is copied here first, least recently used out first when the tier
  is full; a later prefix lookup that misses the device finds it here and copies
  it back instead of recomputing its tokens;
- a preempted sequence's blocks (swapped out), held until it is admitted again
  and swapped back in; these are never evicted, and a sequence that does not fit
  is recomputed instead.

The tier's tensor holds each block's rows of every layer, K and V, contiguously
([blocks, layers, 2, block_size, ...], the cache's dtype), so that a block moves
between a CUDA cache and the tier as one DMA of contiguous host memory (torch
gathers the device side's strided rows on the device). On a CUDA cache the tier
is page-locked at its exact size (``cuMemHostRegister``): torch's pinned
allocator rounds each allocation up to a power of two, which would lock up to
twice the configured bytes. Counters (for
Status and the metrics): blocks held, swaps out and in, prefix blocks served.
``on_copy``, when set, hears of every copy (``("out", blocks, host)`` or
``("in", host, blocks)``): tensor-parallel ranks make the same copies of their own
heads (tandem/engine/parallel.py), so only this one decides where blocks go.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class HostTier:
    on_copy: Callable[[tuple], None] | None = None

    def __init__(self, cache: torch.Tensor, num_blocks: int) -> None:
        """``cache``: the engine's KV tensor [layers, 2, blocks + 1, block_size, ...]."""
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        shape = (num_blocks, *cache.shape[:2], *cache.shape[3:])
        self.tensor = torch.zeros(shape, dtype=cache.dtype)
        if cache.is_cuda:
            with torch.cuda.device(cache.device):  # its context, not device 0's
                _page_lock(self, self.tensor)
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))
        self._prefix: OrderedDict[int, int] = OrderedDict()  # hash -> block, oldest first
        self.held_blocks = 0  # out of the LRU: swapped sequences', prefix blocks taken
        self.swaps_out = 0
        self.swaps_in = 0
        self.prefix_hits = 0  # blocks served back from the tier

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    # --- prefix blocks ---

    def save_prefix(self, block_hash: int, cache: torch.Tensor, block: int) -> None:
        """Keep a copy of device block ``block`` (content ``block_hash``) before the
        device reuses it; evicts the least recently saved prefix block if full, and
        drops the copy if every block is held by swapped sequences."""
        if block_hash in self._prefix:
            self._prefix.move_to_end(block_hash)
            return
        host = self._take(1)
        if host is None:
            return
        try:
            self.copy_out(cache, [block], host)
        except BaseException:  # nothing kept: the block is free again
            self._free.extend(host)
            raise
        self._prefix[block_hash] = host[0]

    def has_prefix(self, block_hash: int) -> bool:
        return block_hash in self._prefix

    def take_prefix(self, block_hash: int) -> int:
        """Take a saved prefix block out of the LRU (its copy stays until ``restore``)."""
        host = self._prefix.pop(block_hash)
        self.held_blocks += 1  # until restored
        return host

    def restore(self, host: int, cache: torch.Tensor, block: int) -> None:
        """Copy a taken prefix block into device block ``block`` and free it here (the
        device holds it now, and saves it again if it reuses the block)."""
        self.copy_in(cache, [host], [block])
        self.release([host])
        self.prefix_hits += 1

    # --- swapped sequences ---

    def swap_out(self, cache: torch.Tensor, blocks: list[int]) -> list[int] | None:
        """Copy ``blocks`` out to the tier (evicting prefix blocks for room); None, and
        nothing taken, when the tier cannot hold them."""
        host = self._take(len(blocks))
        if host is None:
            return None
        try:
            self.copy_out(cache, blocks, host)
        except BaseException:  # nothing taken: the blocks are free again
            self._free.extend(host)
            raise
        self.held_blocks += len(blocks)
        self.swaps_out += 1
        return host

    def swap_in(self, host: list[int], cache: torch.Tensor, blocks: list[int]) -> None:
        """Copy a swapped sequence's blocks back into device ``blocks`` and free them here."""
        self.copy_in(cache, host, blocks)
        self.release(host)
        self.swaps_in += 1

    def release(self, host: list[int]) -> None:
        """Free held blocks (copied back, or of a swapped sequence that ended)."""
        self._free.extend(host)
        self.held_blocks -= len(host)

    def _take(self, n: int) -> list[int] | None:
        """``n`` free blocks, evicting the least recently saved prefix blocks for room;
        None, and nothing evicted, when even that is not enough."""
        if n > len(self._free) + len(self._prefix):
            return None
        while len(self._free) < n:
            _, oldest = self._prefix.popitem(last=False)
            self._free.append(oldest)
        return [self._free.pop() for _ in range(n)]

    # --- copies ---

    def copy_out(self, cache: torch.Tensor, blocks: list[int], host: list[int]) -> None:
        """Device ``blocks`` into host blocks ``host``, in order."""
        if self.on_copy is not None:
            self.on_copy(("out", blocks, host))
        for b, h in zip(blocks, host, strict=True):
            self.tensor[h].copy_(cache[:, :, b], non_blocking=True)
        if cache.is_cuda:  # the device blocks are reused right after
            torch.cuda.synchronize(cache.device)

    def copy_in(self, cache: torch.Tensor, host: list[int], blocks: list[int]) -> None:
        """Host blocks ``host`` into device ``blocks``, in order."""
        if self.on_copy is not None:
            self.on_copy(("in", host, blocks))
        for h, b in zip(host, blocks, strict=True):
            cache[:, :, b].copy_(self.tensor[h], non_blocking=True)
        if cache.is_cuda:  # the host blocks are released right after
            torch.cuda.synchronize(cache.device)

    def check_integrity(self) -> None:
        held = len(self._prefix) + self.held_blocks
        assert held + len(self._free) == self.num_blocks, (
            f"host tier: {held} held + {len(self._free)} free != {self.num_blocks}"
        )
        assert len(set(self._free)) == len(self._free), "host tier: a block is free twice"


# cuMemHostRegister's flag: page-locked for every device's context, not only the
# current one's.
_PORTABLE = 1


def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _page_lock(owner: object, tensor: torch.Tensor) -> None:
    """Page-lock ``tensor``'s memory for as long as ``owner`` lives, in the current
    device's context. Through the driver API rather than cudaHostRegister: a failed
    runtime call leaves its error for the next kernel launch's check to raise (torch
    does not clear it), while a driver call's failure ends here. Where the driver
    refuses (the locked-memory limit, say), the tier stays pageable: its copies are
    then staged by the driver, slower, still right."""
    ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    try:
        driver = _driver()
        register, unregister = driver.cuMemHostRegister_v2, driver.cuMemHostUnregister
        register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        unregister.argtypes = [ctypes.c_void_p]
        status = int(register(ptr, size, _PORTABLE))
    except (OSError, AttributeError) as exc:  # no driver library here
        status = f"{type(exc).__name__}: {exc}"
    if status != 0:
        log.warning(
            "host KV tier: page-locking its %d bytes failed (cuMemHostRegister: %s); the "
            "tier stays in pageable memory, and its copies are slower",
            size,
            status,
        )
        return
    # Before the tensor's memory is freed: the owner's weak references are cleared
    # before its attributes are.
    weakref.finalize(owner, unregister, ptr)
