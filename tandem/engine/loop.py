"""The engine on its own thread, driven from asyncio (gRPC servers) safely.

``LLMEngine`` is single-threaded: every call into it happens on the loop thread.
asyncio code hands work over with ``call`` (runs between two steps and returns
the result) and receives a request's outputs on the asyncio queue that
``subscribe`` returned. The thread steps the engine while it has work and
otherwise sleeps until a command arrives, ``wake`` is called (the decode worker's
KV receiver calls it when a transfer ends) or ``poll_interval_s`` passes; hooks
run every iteration (the decode worker admits requests whose KV has arrived
there).

Watchdog (``stall_timeout_s``): an iteration (commands, hooks, one step) is bounded
by one step's work, seconds at most; one that has run for longer than the timeout
never returns (a GPU kernel or a collective that waits forever, a deadlock), and
every request in the engine is stuck with it while the worker still answers
``Status``. A second thread notices and calls ``on_stall`` once, with how long and
where the engine thread is stuck; the worker then exits (worker/server.py). It
watches the engine thread only while it works: one that waits for work is never
stalled, and a busy one finishes an iteration every step.

A failed step ends its requests with ERROR and the loop goes on: the next step may
well succeed (a bug that one request's input reached). Requests that were not in it
(waiting their turn) stay queued. Not after an error of the
device's runtime (``torch.AcceleratorError``: a CUDA error), after which the device's
state is not to be trusted and every later step fails too: a worker that went on
would fail each request it is given, fast, and so look the least loaded. Such a
step goes to ``on_device_fault`` first: the worker tries the device, and if that
fails too it exits, which hands its requests to the router for migration rather
than failing them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from tandem.engine.engine import LLMEngine, RequestOutput
from tandem.engine.sequence import FinishReason

log = logging.getLogger(__name__)
T = TypeVar("T")
_WAKE = None  # a command that only wakes the thread
# An error of the device's runtime (a CUDA error); torch has the class from 2.8 on.
_DEVICE_ERROR = getattr(torch, "AcceleratorError", None)


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        poll_interval_s: float = 0.1,
        stall_timeout_s: float | None = None,
        on_stall: Callable[[float, str], None] | None = None,
        on_device_fault: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``on_stall(seconds, stack)``: called once, on the watchdog's thread, when one
        iteration of the engine thread has run for over ``stall_timeout_s`` (None: no
        watchdog); ``stack`` is where the engine thread is. ``on_device_fault(exc)``:
        called on the engine thread when a step fails with an error of the device's
        runtime, before the step's requests are failed."""
        self.engine = engine
        self._on_device_fault = on_device_fault
        # How often hooks run while idle and nothing wakes the thread: what they wait
        # for (a decode reservation's KV) calls ``wake``, so this is only a fallback.
        self.poll_interval_s = poll_interval_s
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = (
            queue.SimpleQueue()
        )
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Request ids whose handler ended and whose clean-up on the engine thread has not
        # run yet (``end``); touched on the event loop's thread only.
        self._ending: dict[str, asyncio.Future] = {}
        self._hooks: list[Callable[[LLMEngine], None]] = []
        self._step_hooks: list[Callable[[LLMEngine, list[RequestOutput]], None]] = []
        self._stop = threading.Event()
        self.last_step_seconds = 0.0  # the step that the step hooks are called after
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        # When the engine thread took up its current iteration (time.monotonic); None
        # while it waits for work. Written by the engine thread, read by the watchdog.
        self._busy_since: float | None = None
        self._watchdog: threading.Thread | None = None
        if stall_timeout_s is not None:
            if stall_timeout_s <= 0 or on_stall is None:
                raise ValueError("a watchdog needs stall_timeout_s > 0 and on_stall")
            self._watchdog = threading.Thread(
                target=self._watch,
                args=(stall_timeout_s, on_stall),
                name="tandem-engine-watchdog",
                daemon=True,
            )

    def start(self) -> None:
        self._thread.start()
        if self._watchdog is not None:
            self._watchdog.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.wake()
        self._thread.join(timeout)
        if self._watchdog is not None:
            self._watchdog.join(timeout)

    def busy_for(self) -> float:
        """Seconds the engine thread has spent in its current iteration (0: waiting)."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def wake(self) -> None:
        """Run the hooks now rather than at the next poll (from any thread, holding any
        lock: it only queues a token)."""
        self._commands.put(_WAKE)

    def add_hook(self, hook: Callable[[LLMEngine], None]) -> None:
        """Run ``hook(engine)`` on the engine thread every iteration (before each step)."""
        self._hooks.append(hook)

    def add_step_hook(self, hook: Callable[[LLMEngine, list[RequestOutput]], None]) -> None:
        """Run ``hook(engine, outputs)`` on the engine thread after each step, before its
        outputs reach their subscribers (and before the next step starts)."""
        self._step_hooks.append(hook)

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the engine thread between steps (from any thread)."""
        fut: Future[T] = Future()
        self._commands.put((lambda: fn(self.engine), fut))
        return fut

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    def subscribe(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        """An asyncio queue (of the calling event loop) that receives ``request_id``'s outputs.

        Call before the request is added, so no output can be missed.
        """
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._subscribers[request_id] = (asyncio.get_running_loop(), q)
        return q

    def unsubscribe(self, request_id: str) -> None:
        self._subscribers.pop(request_id, None)

    def end(self, request_id: str, cleanup: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """A handler is done with ``request_id`` (from the event loop, in its ``finally``,
        even a cancelled one): no more outputs for it, and ``cleanup(engine)`` queued.
        Until that has run, a step may still hold the old request and deliver its
        outputs: a new call with the id waits (``ended``) rather than receive them."""
        self.unsubscribe(request_id)
        ending = asyncio.wrap_future(self.submit(cleanup))
        self._ending[request_id] = ending

        def forget(done: asyncio.Future) -> None:
            if self._ending.get(request_id) is done:
                del self._ending[request_id]

        ending.add_done_callback(forget)
        return ending

    async def ended(self, request_id: str) -> None:
        """Wait for an earlier call's clean-up of ``request_id`` (one step at most)."""
        ending = self._ending.get(request_id)
        if ending is not None:
            await asyncio.wait((ending,))

    # ---- engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        # Scheduler work, not engine.has_unfinished(): a decode-side reservation waiting
        # for its KV is unfinished but has nothing to step, and must not spin the thread.
        scheduler = self.engine.scheduler
        stepped = stuck = False
        while not self._stop.is_set():
            self._busy_since = time.monotonic()
            # After a step the hooks see its outcome (the worker's published load) before
            # the thread sleeps, not a poll interval later. Work that could not be
            # scheduled (every block held, by transfers say) waits as an idle thread
            # does, for a command, a wake-up or the poll interval: not in a spin.
            done = self._drain_commands(block=stuck or (not stepped and not scheduler.has_work()))
            stepped = stuck = False
            for hook in self._hooks:
                try:
                    hook(self.engine)
                except Exception:  # a hook's bug must not stop serving
                    log.exception("engine hook failed")
            # Callers hear of their commands once the hooks have seen them: the load a
            # worker publishes already counts a reservation its caller was told of.
            for fut, result, error in done:
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(error)
            if not scheduler.has_work():
                continue
            stepped = True
            started = time.perf_counter()
            before = self.engine.request_ids, self.engine.held_ids
            try:
                outputs = self.engine.step()
                self.last_step_seconds = time.perf_counter() - started
            except Exception as exc:
                if _DEVICE_ERROR and isinstance(exc, _DEVICE_ERROR) and self._on_device_fault:
                    self._on_device_fault(exc)
                log.exception("engine step failed; aborting its requests")
                self._fail_all(*before)
                continue
            if not self.engine.stats.last_sequences:  # nothing was scheduled: no step
                stepped, stuck = False, True
                continue
            for hook in self._step_hooks:
                try:
                    hook(self.engine, outputs)
                except Exception:
                    log.exception("engine step hook failed")
            for out in outputs:
                self._deliver(out)

    def _drain_commands(self, block: bool) -> list[tuple[Future, Any, BaseException | None]]:
        """Run the queued commands (waiting up to a poll interval for one if ``block``);
        returns each one's future with its result or error, not yet resolved."""
        timeout = self.poll_interval_s if block else None
        done: list[tuple[Future, Any, BaseException | None]] = []
        while True:
            try:
                if timeout is not None:
                    self._busy_since = None
                    try:
                        command = self._commands.get(timeout=timeout)
                    finally:
                        self._busy_since = time.monotonic()
                    timeout = None
                else:
                    command = self._commands.get_nowait()
            except queue.Empty:
                return done
            if command is _WAKE:
                continue
            fn, fut = command
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                done.append((fut, fn(), None))
            except BaseException as exc:  # handed back to the caller
                done.append((fut, None, exc))

    def _deliver(self, out: RequestOutput) -> None:
        sub = self._subscribers.get(out.request_id)
        if sub is None:
            return
        loop, q = sub
        if out.finished:
            self._subscribers.pop(out.request_id, None)
        try:
            loop.call_soon_threadsafe(q.put_nowait, out)
        except RuntimeError:  # the subscriber's event loop is gone
            self._subscribers.pop(out.request_id, None)

    def _fail_all(self, requests_before: frozenset[str], held_before: frozenset[str]) -> None:
        """After a failed step: its requests end with ERROR. Not the KV of transfers in
        flight: freed now, its blocks would go to other requests while a transfer still
        reads or writes them. The step's outputs are lost with it, so a request that it
        finished, or held for a transfer (its owner frees that KV), is told too."""
        aborted = self.engine.abort_failed_step()
        held = self.engine.held_ids
        finished = requests_before - self.engine.request_ids - held - set(aborted)
        for request_id in [*aborted, *(held - held_before), *finished]:
            self._deliver(
                RequestOutput(request_id, [], "", finished=True, finish_reason=FinishReason.ERROR)
            )

    # ---- watchdog thread -------------------------------------------------------------

    def _watch(self, timeout_s: float, on_stall: Callable[[float, str], None]) -> None:
        while not self._stop.wait(min(1.0, timeout_s / 4)):
            busy = self.busy_for()
            if busy > timeout_s:
                frame = sys._current_frames().get(self._thread.ident)
                stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
                on_stall(busy, stack)
                return
