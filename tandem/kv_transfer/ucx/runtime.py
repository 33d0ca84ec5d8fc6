"""One background thread per process that owns ucxx and its asyncio loop.

ucxx keeps a single context per process, bound to the event loop it was created
in, so every UCX sender and receiver in a process shares this thread. Public
methods of senders and receivers run on their callers' threads and hand work
here with ``submit`` (a concurrent Future) or ``call_soon`` (fire and forget, in
order).

ucxx is started with Python-future notification (a notifier thread wakes the
loop when a UCX request completes). The default polls each pending request from
the loop, which keeps one CPU core busy whenever a receive is outstanding, i.e.
always. The notifier thread is not a daemon, so it is stopped before the
interpreter joins threads at exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Coroutine, MutableMapping
from concurrent.futures import Future
from typing import Any, TypeVar

from tandem.security.tls import is_loopback

log = logging.getLogger(__name__)
T = TypeVar("T")

_lock = threading.Lock()
_runtime: UcxRuntime | None = None


# What a worker whose KV cache is on a GPU adds to UCX_TLS: copies between host and
# device (cuda_copy) and reads straight from another process's GPU memory on the
# same node (cuda_ipc); across nodes GPUDirect RDMA comes with ``rc`` or ``dc``,
# which operators name themselves.
CUDA_TLS = "cuda_copy,cuda_ipc"


def ucx_env_defaults(
    env: MutableMapping[str, str] | None = None,
    tls: str | None = "tcp,sm,self",
    cuda: bool = False,
    host: str | None = None,
) -> MutableMapping[str, str]:
    """Set Tandem's UCX defaults in ``env`` (``os.environ`` when None) where unset; returns it.

    UCX reads its environment once, at context creation, so a process calls this
    before any UCX endpoint exists (or passes the mapping to a child process).
    ``tls`` (None: leave UCX_TLS to UCX) suits one host: shared memory between local
    peers, next to TCP, which loopback needs for its listeners; ``cuda`` (the KV cache
    is on a GPU) adds CUDA_TLS to it. Across hosts operators set UCX_TLS themselves
    (to include ``rc``/``ud`` for RDMA, say), and what the environment already holds
    wins.

    ``host``: where the worker listens. A loopback host keeps UCX's TCP transport on
    the loopback device too: by default it opens a listener on every interface of
    the machine, reachable from the network before any of Tandem's checks. (Other
    hosts leave the devices to UCX and the operator: naming the host's interface
    would also leave out the RDMA devices that carry KV between nodes.)
    """
    env = os.environ if env is None else env
    if tls is not None:
        env.setdefault("UCX_TLS", f"{tls},{CUDA_TLS}" if cuda else tls)
    if cuda:
        # A decode worker reads the prefill worker's blocks with gets. UCX's default
        # ("auto") turns cuda_ipc's gets off on a GPU without an active NVLink (a PCIe
        # card, one GPU of a VM), and the reads then take a path through the host.
        env.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
    if host is not None and is_loopback(host):
        env.setdefault("UCX_NET_DEVICES", "lo")
    # Without this UCX warns about the UCX_* variables that ucxx itself sets.
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # Endpoints here use peer-failure error handling (a killed peer fails its
    # transfers at once). UCX only picks transports that advertise peer failure,
    # which by default leaves shared memory out and moves every byte over TCP
    # loopback on one host (10x slower); this turns on keepalive-based failure
    # detection for the shared-memory transports so they qualify.
    env.setdefault("UCX_MM_ERROR_HANDLING", "y")
    # UCX logs to stdout by default (block-buffered into a pipe, and not the log a
    # worker's stderr goes to); its reasons for a failed start belong in that log.
    env.setdefault("UCX_LOG_FILE", "stderr")
    return env


def on_gpu(device: str) -> bool:
    """Whether an engine set to ``device`` ("auto", "cpu", "cuda:1") keeps its KV cache
    on a GPU: what ``cuda`` of ``ucx_env_defaults`` should say for its worker."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def get_runtime() -> UcxRuntime:
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = UcxRuntime()
        return _runtime


class UcxRuntime:
    def __init__(self) -> None:
        # UCX reads its environment once, at context creation: set defaults before that.
        ucx_env_defaults(tls=None)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="tandem-ucx", daemon=True)
        self._thread.start()
        self.submit(self._init()).result(timeout=60)
        _register_exit_hook(self.shutdown)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _init(self) -> None:
        import ucxx

        # init() captures the running loop (ours) for progress and notification.
        if ucxx.core._ctx is None:
            ucxx.init(progress_mode="thread", enable_python_future=True)
        self.ucxx = ucxx
        # ucp_context_h and ucp_worker_h, for the RMA calls ucxx does not wrap (ucp.py).
        self.context: int = ucxx.core._get_ctx().context.handle
        self.worker: int = ucxx.get_ucp_worker()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread; calls from one thread keep their order."""
        self.loop.call_soon_threadsafe(fn, *args)

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def shutdown(self) -> None:
        try:
            self.ucxx.stop_notifier_thread()
        except Exception:  # interpreter exit: best effort
            log.debug("stopping the ucxx notifier thread failed", exc_info=True)


def _register_exit_hook(fn: Callable[[], None]) -> None:
    # threading._register_atexit runs before non-daemon threads are joined (atexit runs
    # after, too late to stop the notifier thread). Same hook as concurrent.futures.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(fn)
    else:  # pragma: no cover
        import atexit

        atexit.register(fn)
