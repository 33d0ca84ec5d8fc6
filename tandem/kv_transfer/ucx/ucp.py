"""The UCP calls that ucxx's Python API lacks: memory handles, remote keys, one-sided reads.

ucxx 0.52 wraps tag messages; the libucp it loads (from the libucx wheel) also has
RMA. These bindings call that same library through ctypes, on ucxx's own context,
worker and endpoints, so a process runs one UCX: one set of transports, one
environment, one set of memory hooks.

    Memory.allocate(ctx, n)     n bytes allocated by UCX: shared memory (sysv or posix)
                                when UCX can, so a peer on this host can map it
    Memory.register(ctx, addr)  existing host or CUDA memory, for reads from peers
    memory.pack_rkey()          what a peer needs to reach it (bytes, sent once)
    RemoteKey(ep, packed)       the peer's key, on the endpoint to that peer
    rkey.pointer(addr)          where the peer's memory is mapped in this process, if it
                                can be (UCX-allocated shared memory on the same host)
    get(worker, ep, rkey, ...)  one-sided reads into local memory; returns once all landed

Calls are thread-safe: ucxx creates its worker in UCS_THREAD_MODE_MULTI (checked by
``check_thread_mode``). Struct layouts follow ucp.h of UCX 1.x (offsets checked
against the headers the libucx wheel ships: request param 72 bytes, memh at 64).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Sequence

_VP = ctypes.c_void_p
# ucs_status_t values used here (ucs/type/status.h).
UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_CANCELED = -16
_UCS_ERR_LAST = -100
UCS_THREAD_MODE_MULTI = 2
UCS_MEMORY_TYPE_HOST = 0
UCS_MEMORY_TYPE_CUDA = 1
# ucp_mem_map_params field_mask bits and flags.
_MAP_ADDRESS, _MAP_LENGTH, _MAP_FLAGS, _MAP_MEMORY_TYPE = 1, 2, 4, 16
_MAP_ALLOCATE = 2
# ucp_mem_attr field_mask bits.
_ATTR_ADDRESS, _ATTR_LENGTH = 1, 2
# ucp_request_param op_attr_mask bits.
_OP_MEMH = 1 << 8


class UcpError(RuntimeError):
    """A UCP call failed; ``status`` is its ucs_status_t."""

    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"{what}: {_status_text(status)}")
        self.status = status


class _MemMapParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", _VP),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", _VP),
    ]


class _MemAttr(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", _VP),
        ("length", ctypes.c_size_t),
        ("mem_type", ctypes.c_int),
    ]


class _RequestParam(ctypes.Structure):
    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", _VP),
        ("cb", _VP),
        ("datatype", ctypes.c_uint64),
        ("user_data", _VP),
        ("reply_buffer", _VP),
        ("memory_type", ctypes.c_int),
        ("recv_info", _VP),
        ("memh", _VP),
    ]


class _WorkerAttr(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("thread_mode", ctypes.c_int)]


def _declare(lib: ctypes.CDLL, name: str, restype, *argtypes) -> None:
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = restype, list(argtypes)


def _load() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """libucp and libucs as ucxx loaded them (the same files, so the same handles)."""
    import libucx

    libdir = os.path.join(os.path.dirname(libucx.__file__), "lib")
    ucs = ctypes.CDLL(os.path.join(libdir, "libucs.so"), ctypes.RTLD_LOCAL)
    ucp = ctypes.CDLL(os.path.join(libdir, "libucp.so"), ctypes.RTLD_LOCAL)
    _declare(ucs, "ucs_status_string", ctypes.c_char_p, ctypes.c_int)
    status, pvp = ctypes.c_int, ctypes.POINTER(_VP)
    _declare(ucp, "ucp_mem_map", status, _VP, ctypes.POINTER(_MemMapParams), pvp)
    _declare(ucp, "ucp_mem_unmap", status, _VP, _VP)
    _declare(ucp, "ucp_mem_query", status, _VP, ctypes.POINTER(_MemAttr))
    _declare(ucp, "ucp_rkey_pack", status, _VP, _VP, pvp, ctypes.POINTER(ctypes.c_size_t))
    _declare(ucp, "ucp_rkey_buffer_release", None, _VP)
    _declare(ucp, "ucp_ep_rkey_unpack", status, _VP, ctypes.c_char_p, pvp)
    _declare(ucp, "ucp_rkey_ptr", status, _VP, ctypes.c_uint64, pvp)
    _declare(ucp, "ucp_rkey_destroy", None, _VP)
    _declare(
        ucp,
        "ucp_get_nbx",
        _VP,
        _VP,
        _VP,
        ctypes.c_size_t,
        ctypes.c_uint64,
        _VP,
        ctypes.POINTER(_RequestParam),
    )
    _declare(ucp, "ucp_request_check_status", status, _VP)
    _declare(ucp, "ucp_request_cancel", None, _VP, _VP)
    _declare(ucp, "ucp_request_free", None, _VP)
    _declare(ucp, "ucp_worker_progress", ctypes.c_uint, _VP)
    _declare(ucp, "ucp_worker_query", status, _VP, ctypes.POINTER(_WorkerAttr))
    return ucp, ucs


_ucp, _ucs = _load()


def _status_text(status: int) -> str:
    text = _ucs.ucs_status_string(status)
    return f"{text.decode() if text else 'unknown status'} ({status})"


def _check(what: str, status: int) -> None:
    if status != UCS_OK:
        raise UcpError(what, status)


def check_thread_mode(worker: int) -> None:
    """Raise unless ``worker`` takes calls from any thread (ucxx's default)."""
    attr = _WorkerAttr(field_mask=1)
    _check("ucp_worker_query", _ucp.ucp_worker_query(worker, ctypes.byref(attr)))
    if attr.thread_mode != UCS_THREAD_MODE_MULTI:
        raise RuntimeError(f"the UCX worker is in thread mode {attr.thread_mode}, not MULTI")


class Memory:
    """A range of memory mapped with ``ucp_mem_map``; ``close`` unmaps it (once)."""

    def __init__(self, context: int, params: _MemMapParams, what: str) -> None:
        handle = _VP()
        _check(what, _ucp.ucp_mem_map(context, ctypes.byref(params), ctypes.byref(handle)))
        attr = _MemAttr(field_mask=_ATTR_ADDRESS | _ATTR_LENGTH)
        _check("ucp_mem_query", _ucp.ucp_mem_query(handle, ctypes.byref(attr)))
        self.context = context
        self.handle: int | None = handle.value
        self.address: int = attr.address
        self.length: int = attr.length

    @classmethod
    def allocate(cls, context: int, nbytes: int) -> Memory:
        """``nbytes`` of host memory allocated by UCX, in its preferred order (shared
        memory first), so that ``RemoteKey.pointer`` works for peers on this host."""
        params = _MemMapParams(
            field_mask=_MAP_ADDRESS | _MAP_LENGTH | _MAP_FLAGS,
            address=None,
            length=nbytes,
            flags=_MAP_ALLOCATE,
        )
        return cls(context, params, f"allocating {nbytes} bytes with ucp_mem_map")

    @classmethod
    def register(cls, context: int, address: int, nbytes: int, cuda: bool = False) -> Memory:
        """Existing memory (host, or CUDA with ``cuda``), for peers' reads."""
        params = _MemMapParams(
            field_mask=_MAP_ADDRESS | _MAP_LENGTH | _MAP_MEMORY_TYPE,
            address=address,
            length=nbytes,
            memory_type=UCS_MEMORY_TYPE_CUDA if cuda else UCS_MEMORY_TYPE_HOST,
        )
        return cls(context, params, f"registering {nbytes} bytes with ucp_mem_map")

    def pack_rkey(self) -> bytes:
        buf, size = _VP(), ctypes.c_size_t()
        _check(
            "ucp_rkey_pack",
            _ucp.ucp_rkey_pack(self.context, self.handle, ctypes.byref(buf), ctypes.byref(size)),
        )
        try:
            return ctypes.string_at(buf, size.value)
        finally:
            _ucp.ucp_rkey_buffer_release(buf)

    def close(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            _check("ucp_mem_unmap", _ucp.ucp_mem_unmap(self.context, handle))


class RemoteKey:
    """A peer's packed key, unpacked on the endpoint to that peer; ``close`` only once
    no read through it is in flight. Before its owner closes the endpoint it calls
    ``detach``: reads posted later fail instead of reaching a freed endpoint."""

    def __init__(self, endpoint: int, packed: bytes) -> None:
        handle = _VP()
        _check(
            "ucp_ep_rkey_unpack", _ucp.ucp_ep_rkey_unpack(endpoint, packed, ctypes.byref(handle))
        )
        self.endpoint: int | None = endpoint
        self.handle: int | None = handle.value
        self.posting = threading.Lock()  # held while reads are posted on the endpoint

    def detach(self) -> None:
        """No read is posted on the endpoint from now on (one being posted finishes)."""
        with self.posting:
            self.endpoint = None

    def pointer(self, remote_address: int) -> tuple[int | None, str]:
        """(the local address at which ``remote_address`` is mapped, '') or, when the
        peer's memory cannot be mapped here, (None, why): another host, memory UCX
        did not allocate in shared memory, or a segment this process may not attach
        (another IPC namespace, say)."""
        out = _VP()
        status = _ucp.ucp_rkey_ptr(self.handle, remote_address, ctypes.byref(out))
        if status != UCS_OK:
            return None, _status_text(status)
        return out.value, ""

    def close(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            _ucp.ucp_rkey_destroy(handle)


def _request(ptr: int | None) -> tuple[int, int | None]:
    """(status, request) from a ucs_status_ptr_t."""
    if ptr is None:
        return UCS_OK, None
    if ptr >= (1 << 64) + _UCS_ERR_LAST:  # UCS_PTR_IS_ERR
        return ptr - (1 << 64), None
    return UCS_INPROGRESS, ptr


def get(
    worker: int,
    rkey: RemoteKey,
    reads: Sequence[tuple[int, int, int]],
    local: Memory | None,
    timeout_s: float,
    on_timeout: Callable[[], None] | None = None,
) -> None:
    """Read each (local address, remote address, bytes) of ``reads`` from the peer;
    returns once every read landed, else UcpError (a read failed: peer lost) or
    TimeoutError. ``local``: the registration the local addresses lie in, if any.

    On any failure the reads still in flight are waited for before this raises, so
    nothing more lands in local memory afterwards. UCX cancels tag receives only, not
    gets: a get ends when it lands or its endpoint fails, so a peer that stopped
    answering (a frozen process, over TCP) holds it past ``timeout_s``. Then
    ``on_timeout`` is called, once: it should end the endpoint (the receiver drops
    the connection), which fails the reads in flight.
    """
    param = _RequestParam()
    if local is not None:
        param.op_attr_mask, param.memh = _OP_MEMH, local.handle
    pending: list[int] = []
    failure: UcpError | TimeoutError | None = None
    with rkey.posting:
        if rkey.endpoint is None:  # the connection is closing: its endpoint may be gone
            raise UcpError("ucp_get_nbx", UCS_ERR_CANCELED)
        for dst, src, nbytes in reads:
            status, req = _request(
                _ucp.ucp_get_nbx(rkey.endpoint, dst, nbytes, src, rkey.handle, ctypes.byref(param))
            )
            if req is not None:
                pending.append(req)
            elif status != UCS_OK:
                failure = UcpError("ucp_get_nbx", status)
                break
    deadline = time.monotonic() + timeout_s
    spins = 0
    for req in pending:
        cancelled = False
        while (status := _ucp.ucp_request_check_status(req)) == UCS_INPROGRESS:
            if failure is None and time.monotonic() > deadline:
                failure = TimeoutError(f"UCX reads not done within {timeout_s:g} s")
            if failure is not None and not cancelled:
                _ucp.ucp_request_cancel(worker, req)
                cancelled = True
                if isinstance(failure, TimeoutError) and on_timeout is not None:
                    try:
                        on_timeout()
                    except Exception:  # its owner is closing (which ends the endpoint)
                        pass  # the reads must still be waited for, below
                    on_timeout = None
            # Progress here too: a waiting reader need not wait for the progress
            # thread's next wake-up. Spin briefly, then yield the core in short naps.
            _ucp.ucp_worker_progress(worker)
            spins += 1
            if spins > 100:
                time.sleep(1e-4)
        _ucp.ucp_request_free(req)
        if status != UCS_OK and failure is None:
            failure = UcpError("ucp_get_nbx", status)
    if failure is not None:
        raise failure
