"""A process the local launcher starts dies with the launcher, however the launcher dies.

Why: LocalCluster starts the router and the workers in sessions of their own
(``start_new_session=True``) so that a Ctrl-C reaches only the launcher, which
stops them in order. When the launcher dies without stopping them (SIGKILL, a
crash, an OOM kill), nothing else would: they keep their ports and memory, and
the next ``tandem serve`` on the same port fails to bind.

Mechanism: a pipe nobody writes to. The launcher makes one per cluster and
keeps its write end (close-on-exec, so no child inherits it); each child gets
the read end (``pass_fds``) and its number in ``TANDEM_LIFELINE_FD``, and a
daemon thread in the child blocks reading it. The read returns only at end of
file, which comes when the kernel closes the write end: when the launcher
process exits, whatever ended it.

Why not the alternatives: PR_SET_PDEATHSIG fires when the *thread* that forked
the child exits, not the process, so a cluster started from a worker thread
(an executor, a test) would be killed as soon as that thread returned; it also
needs ``preexec_fn``, which is unsafe in a threaded launcher. Polling
``os.getppid()`` works but notices only at the next poll; the pipe wakes the
child at once and has no pid-reuse race.

A stopped child (SIGSTOP, a debugger, a job-control stop) runs no thread, so it
would never read the EOF. So the child also asks the kernel for SIGCONT when its
parent exits (PR_SET_PDEATHSIG with SIGCONT, set by the child itself, not in
``preexec_fn``): the stopped child resumes and its watch reads the EOF. SIGCONT to
a running process does nothing, so a signal sent early (the forking thread ended)
is harmless. Tensor-parallel ranks, whose lifeline is their stdin, do the same.

On launcher death the child sends itself SIGTERM, which takes the path of an
ordinary ``kill``: stop accepting, close streams and the KV transport with
their own shutdown code, exit. A clean stop is tried first because some
resources outlive a process that just vanishes (UCX shared-memory segments,
half-sent streams). It is bounded by ``alarm(GRACE_S)``, whose SIGALRM ends
the process by the kernel's default action: nobody is left to SIGKILL a child
whose drain hangs (the configured drain may be 30 s), and its port must be free
within seconds for the next start. The bound is a kernel timer, not a Python
thread, because the interpreter's own exit can hang (a native library's
teardown) after it has stopped running daemon threads. So no child may install
a SIGALRM handler or use ``alarm`` itself.

Use: the launcher starts ``python -m tandem.deploy.lifeline MODULE ARGS...``,
which arms the watch (only when ``TANDEM_LIFELINE_FD`` is set) and then runs
MODULE as ``python -m MODULE ARGS...`` would, so the entry points themselves
(tandem.router, tandem.prefill_worker, tandem.decode_worker) need no code for it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import runpy
import signal
import sys
import threading

ENV = "TANDEM_LIFELINE_FD"
_PR_SET_PDEATHSIG = 1
GRACE_S = 2  # SIGTERM to SIGALRM (whole seconds); detection is immediate, so gone in ~2 s

log = logging.getLogger("tandem.deploy.lifeline")  # __name__ is __main__ when run


class Lifeline:
    """The launcher's end: children started with ``command``, ``env`` and ``pass_fds``
    watch it; ``close`` (or the launcher's death) tells them to stop."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()  # both close-on-exec

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self._read_fd,)

    @staticmethod
    def command(module: str, args: list[str]) -> list[str]:
        return [sys.executable, "-m", "tandem.deploy.lifeline", module, *args]

    def env(self, env: dict[str, str]) -> dict[str, str]:
        # PYTHONSAFEPATH: "python -m" would put the launcher's working
        # directory first on the children's module path, where any queue.py or
        # logging.py there took the place of the standard library's, in processes
        # that hold the cluster's keys.
        return {**env, ENV: str(self._read_fd), "PYTHONSAFEPATH": "1"}

    def close(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass  # already closed


def continue_when_orphaned() -> None:
    """Have the kernel send this process SIGCONT when its parent exits, so that a
    stopped process runs again and its own watch sees the parent gone. Linux only
    (elsewhere a stopped child stays stopped until continued)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGCONT, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG): %s", os.strerror(ctypes.get_errno()))


def watch(fd: int, grace_s: int = GRACE_S) -> threading.Thread:
    """In the child (main thread): stop this process once ``fd`` (the read end) reaches EOF."""
    continue_when_orphaned()
    os.set_inheritable(fd, False)  # our own children are not the launcher's to watch
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the alarm must end the process

    def run() -> None:
        try:
            while os.read(fd, 1):  # nobody writes: returns b"" at EOF
                pass
        except OSError:
            pass
        log.warning("launcher gone; stopping (killed by SIGALRM in %d s)", grace_s)
        signal.alarm(grace_s)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=run, name="lifeline", daemon=True)
    thread.start()
    return thread


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m tandem.deploy.lifeline MODULE [ARGS...]")
    module, args = argv[0], argv[1:]
    fd = os.environ.pop(ENV, None)
    if fd is not None:
        watch(int(fd))
    sys.argv = [module, *args]  # run_module replaces argv[0] with the module's file
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
