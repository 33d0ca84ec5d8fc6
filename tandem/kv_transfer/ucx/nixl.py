"""The NIXL data path: the decode worker reads a request's blocks straight out of the
prefill worker's KV cache, into its own reserved blocks, with one-sided RDMA reads.

    prefill worker (sender)                    decode worker (receiver)
    NixlKV(kv): the cache registered once      NixlKV(kv): the cache registered once
    after the handshake, frame b"M":
      agent metadata, cache address, blocks -> add_remote (once per connection)
    per message, frame b"K" + header           under the reservation's write lock:
      (checksum of the source blocks,            read(): one descriptor per layer, K/V
       read where they lie; no payload)          and run of blocks -> READ, wait
                                                 checksum of the destination blocks
                                               ack on the final message, as over UCX

No gather, no staging, no scatter: the bytes cross once, from cache to cache. What
the UCX control channel already gives stays as it is: the fingerprint and secret
handshake, leases, aborts, acks and peer loss. Why reads and not writes: every write
into the decode worker's blocks is then one the decode worker posted itself and
waits for under the reservation's write lock, so once an abort or a lease expiry has
returned, nothing lands in those blocks any more, whatever the sender does. A
sender pushing one-sided writes could still write into blocks that the decode worker
has already given to another request. The price is on the prefill side: it keeps a
request's blocks until the decode worker has acked them (``copies_on_send`` False).

What a bad payload costs: a read that fails its checksum has landed in the
reservation's blocks, which are never decoded (the request FAILS "checksum") and are
rewritten by their next owner.

NIXL brings its own UCX (``nixl-cu12``); it reads the same ``UCX_*`` environment.
Registration covers host or CUDA memory ("DRAM" / "VRAM"); the checksums copy a GPU
cache to the host run by run (payload.checksum_blocks).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from tandem.kv_transfer.base import TransferError
from tandem.kv_transfer.payload import paired_runs
from tandem.kv_transfer.ucx.runtime import get_runtime

log = logging.getLogger(__name__)
# How long one read may stay in progress before it is given up ("timeout").
READ_TIMEOUT_S = 30.0


def available() -> bool:
    """Whether the NIXL package is installed (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("nixl_cu12") is not None


@dataclass(frozen=True)
class RemoteKV:
    """A peer's cache as this side reads it: its agent, base address and block count."""

    agent: str
    base: int
    total_blocks: int  # the blocks dim, null block included
    device: int = 0  # its CUDA device, for a GPU cache


def _mem_type(kv: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", kv.device.index or 0) if kv.is_cuda else ("DRAM", 0)


# How often a process's agents progress UCX when nothing waits on them (a reader
# progresses its own reads while it waits for them; this serves connection set-up
# and the peer side of reads). NIXL's own progress thread is not used: its Python
# wrapper makes it busy-poll, a whole core in every process, idle or not. Ours
# costs about 2% of a core idle, and a 16 MiB read took as long as with NIXL's.
PROGRESS_INTERVAL_S = 0.005
# Every NIXL call in the process holds it (the agents run without NIXL's own
# locking, which the wrapper only turns on with its listener thread); never held
# while a read is waited on.
_calls_lock = threading.RLock()
# What NIXL's UCX reads differently from ucxx's (both read UCX_* from the
# environment when their context is created; None: unset for NIXL).
# - UCX_MM_ERROR_HANDLING: keepalive-based failure detection on the shared-memory
#   transports, which the UCX control channel needs (runtime.ucx_env_defaults),
#   made NIXL's UCX crash in its keepalive (SIGSEGV in ucp_ep_is_cm_local_connected)
#   a few seconds after its first connection. NIXL reads through CMA, which detects
#   a dead peer without it (the read fails at once: tests/kv_transfer/test_ucx.py).
# - UCX_RNDV_THRESH: ucxx sets 8192 in the environment when it starts, and with it
#   UCX served NIXL's reads by software emulation over TCP loopback instead of one
#   CMA copy (UCX_PROTO_INFO=y), about 5x slower at 64 MiB.
NIXL_UCX_ENV: dict[str, str | None] = {"UCX_MM_ERROR_HANDLING": "n", "UCX_RNDV_THRESH": None}


@contextlib.contextmanager
def _environment(values: dict[str, str | None]):
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _route_nixl_logs() -> None:
    """NIXL's Python logger writes INFO lines to stdout, where a worker's READY line
    goes: send its records through this process's logging (stderr) instead, from
    WARNING up unless NIXL_LOG_LEVEL says otherwise."""
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):
        nixl_log.removeHandler(handler)
    nixl_log.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_log.setLevel(logging.WARNING)


class NixlKV:
    """One NIXL agent over one KV cache, registered once; thread-safe."""

    def __init__(self, kv: torch.Tensor, role: str) -> None:
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError:
            raise RuntimeError(
                "the nixl KV backend needs the nixl-cu12 package (pip install nixl-cu12)"
            ) from None
        _route_nixl_logs()
        if not kv.is_contiguous():
            raise ValueError("a KV cache read in place must be contiguous")
        self.kv = kv
        self.name = f"tandem-{role}-{uuid.uuid4().hex[:12]}"
        self._lock = _calls_lock
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        get_runtime()  # ucxx's UCX has read its environment: NIXL's reads it next
        with self._lock, _environment(NIXL_UCX_ENV):
            self._agent = nixl_agent(self.name, config)
        with self._lock:
            self._registered = self._agent.register_memory(kv)
        self._closed = threading.Event()
        self._progress = threading.Thread(
            target=self._progress_loop, name="tandem-nixl-progress", daemon=True
        )
        self._progress.start()
        self._mem, self._device = _mem_type(kv)
        self._remotes: dict[str, int] = {}  # agent name -> connections using it
        # Bytes of one block of one layer, K or V.
        self.block_bytes = kv[0, 0, 0].numel() * kv.element_size()

    def _progress_loop(self) -> None:
        while not self._closed.wait(PROGRESS_INTERVAL_S):
            with self._lock:
                self._agent.get_new_notifs()  # progresses the UCX worker

    def describe(self) -> bytes:
        """What a reader needs (frame b"M"): this agent and where the cache lies."""
        with self._lock:
            meta = self._agent.get_agent_metadata()
        body = {
            "agent": meta.hex(),
            "base": self.kv.data_ptr(),
            "blocks": self.kv.shape[2],
            "device": self._device,
        }
        return json.dumps(body).encode()

    def add_remote(self, description: bytes) -> RemoteKV:
        """Load a peer's agent from its ``describe()`` (ValueError when malformed)."""
        try:
            body = json.loads(description)
            meta, base, blocks = bytes.fromhex(body["agent"]), int(body["base"]), body["blocks"]
            device = int(body.get("device", 0))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"bad NIXL description: {exc!r}") from None
        if not isinstance(blocks, int) or blocks < 2:
            raise ValueError(f"bad NIXL description: {blocks!r} blocks")
        with self._lock:
            name = self._agent.add_remote_agent(meta)
            name = name.decode() if isinstance(name, bytes) else name
            self._remotes[name] = self._remotes.get(name, 0) + 1
        return RemoteKV(name, base, blocks, device)

    def remove_remote(self, remote: RemoteKV) -> None:
        """The connection that added ``remote`` ended (its reads are over)."""
        with self._lock:
            left = self._remotes.get(remote.agent, 0) - 1
            if left > 0:
                self._remotes[remote.agent] = left
                return
            self._remotes.pop(remote.agent, None)
            try:
                self._agent.remove_remote_agent(remote.agent)
            except Exception:  # already disconnected: nothing left to release
                log.debug("removing NIXL agent %s failed", remote.agent, exc_info=True)

    def _offset(self, total_blocks: int, layer: int, k_or_v: int, block: int) -> int:
        return ((layer * 2 + k_or_v) * total_blocks + block) * self.block_bytes

    def read(
        self,
        remote: RemoteKV,
        src_block_ids: tuple[int, ...],
        dst_block_ids: tuple[int, ...],
        layers: tuple[int, int],
        timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        """Copy the peer's ``src_block_ids`` of ``layers`` into this cache's
        ``dst_block_ids``; returns once they have landed, else TransferError."""
        bad = [b for b in src_block_ids if b >= remote.total_blocks - 1]
        if bad:
            raise TransferError("bad header", f"source block ids {bad} outside the sender's pool")
        local_blocks = self.kv.shape[2]
        local, far = [], []
        runs = paired_runs(src_block_ids, dst_block_ids)
        for layer in range(*layers):
            for k_or_v in (0, 1):
                for src, dst, n in runs:
                    size = n * self.block_bytes
                    at = self._offset(local_blocks, layer, k_or_v, dst)
                    local.append((self.kv.data_ptr() + at, size, self._device))
                    at = self._offset(remote.total_blocks, layer, k_or_v, src)
                    far.append((remote.base + at, size, remote.device))
        with self._lock:
            try:
                handle = self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(local, self._mem),
                    self._agent.get_xfer_descs(far, self._mem),
                    remote.agent,
                )
                state = self._agent.transfer(handle)
            except Exception as exc:  # a peer that went away raises here
                raise TransferError("peer lost", f"NIXL read: {exc!r}") from None
        try:
            self._wait(handle, state, timeout_s)
        finally:
            with self._lock:
                try:
                    # Releasing a read still in progress aborts it.
                    self._agent.release_xfer_handle(handle)
                except Exception:
                    log.error("a NIXL read could not be released", exc_info=True)

    def _wait(self, handle, state: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        spins = 0
        while state == "PROC":
            if time.monotonic() > deadline:
                raise TransferError("timeout", f"NIXL read not done within {timeout_s:g} s")
            # Spin briefly (most reads finish in well under a millisecond per MiB),
            # then sleep in short steps so that a slow read does not take a core.
            spins += 1
            time.sleep(0 if spins < 50 else 1e-4)
            try:
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            except Exception as exc:
                raise TransferError("peer lost", f"NIXL read: {exc!r}") from None
        if state != "DONE":
            raise TransferError("peer lost", f"NIXL read ended {state}")

    def close(self) -> None:
        self._closed.set()
        self._progress.join(timeout=5)
        with self._lock:
            for name in list(self._remotes):
                try:
                    self._agent.remove_remote_agent(name)
                except Exception:
                    pass
            self._remotes.clear()
            try:
                self._agent.deregister_memory(self._registered)
            except Exception:
                log.debug("deregistering the KV cache from NIXL failed", exc_info=True)
