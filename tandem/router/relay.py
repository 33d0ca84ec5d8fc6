"""One request's trip through the pools, relayed to the client as one stream.

An *attempt* is one decode reservation plus one prefill:
1. Pick a decode worker and open ``Decode``; its first message is the
   ``KvDestination`` (blocks reserved for prompt + max_tokens). A worker that has
   no room (RESOURCE_EXHAUSTED) or is gone (UNAVAILABLE) is replaced by another,
   each tried once; nothing was computed yet, so that is safe. When no decode
   worker has room, the request waits for one (``DecodeCapacity``), up to its deadline or
   ``queue_timeout_s``: overload is RESOURCE_EXHAUSTED, never UNAVAILABLE.
2. Pick a prefill worker and call ``Prefill(request, destination)``; while the
   call is open (the request waits in the worker's queue, is prefilled, its KV
   is on the wire), the router renews the reservation's lease on the decode
   worker (``RenewLease``), so a busy prefill pool never lets a lease run out
   under a request that is still wanted. The call's first response is the next
   token, sent the moment it is sampled; it goes to the client at once (time to
   first token, with no KV transfer in it). If that token ends the request, the
   response carries finish_reason and usage and the decode stream is cancelled.
   A prefill worker that is gone or busy before its first response
   (UNAVAILABLE, RESOURCE_EXHAUSTED) is replaced by one other. That is safe even
   if the first one got some KV out before it failed: a decode worker takes a
   reservation's KV from one sender only and answers any other "another
   sender", so the retry then fails (ABORTED) instead of delivering twice; and
   after a worker that went away the decode stream is relayed only once the
   retry's KV has landed, so the client never gets a first token that the decode
   worker does not continue from. A prefill worker that gives no first token
   within ``prefill_timeout_s`` ends the request RESOURCE_EXHAUSTED (a hung engine
   must not hold the reservation, whose lease the router renews, for as long as
   the client waits; a queue that long is overload).
3. Relay the decode stream's chunks in order. Until its first chunk (which
   comes once the KV has arrived), the end of the Prefill call is watched too:
   a transfer that fails there (ABORTED) or a prefill worker that dies with the
   KV unsent loses the attempt. The decode worker never resends the token that
   prefill returned, so nothing is duplicated; its last chunk has finish_reason.

**Migration.** The router owns the request until its last token. When an
attempt is lost after its reservation was made (the decode worker dies or its
link breaks mid-stream, its engine fails a step holding the request (a chunk with
finish_reason ERROR), the prefill worker dies or its engine fails the step (INTERNAL
before the first token), or the KV transfer between them fails), a new attempt
starts on another decode worker with the original prompt plus every token already
streamed (``output_token_ids``), and on another prefill
worker: the lost attempt's workers are taken again only when their pool has no
other placeable one (a failed KV transfer leaves both alive, and a fault in either
or between the two would fail the same pair again; and for ``kv_path_cooldown_s``
after a transfer failed, that decode worker's later requests go to other prefill
workers where there are any; not where the decode worker refused it for its own
reasons, kv_transfer.base.NOT_THE_LINK, which the prefill worker's call names in
its trailing metadata). The prefill recomputes their
KV and samples the next token, and the stream goes on with no token duplicated or
missing. Workers replay those tokens through their detokenizer and
stop-string matcher, and seeded sampling draws from (seed, position), so the text
is that of an undisturbed run: in float32 with a float KV cache but for a draw within
about 1e-5 of a boundary (README, "How far a seed reproduces"; an int8
cache's recomputed prefill attends over exact K and V; onto a decode worker with a
KV window the move is prefilled there, see disaggregation.py). In bfloat16 the streamed
tokens' KV, recomputed in one prefill where the lost worker computed it a decode
step at a time, rounds differently, and greedy text can drift after the move (a
near-tie tipped: 2 of 3 moves of one default-model stream diverged, with or without
``int4_max_rows``). At most
``max_migrations`` new attempts; then the client gets the last attempt's error
(UNAVAILABLE; INTERNAL for an engine's failure). Each call and each of its
attempts has its own worker-side request id (``<id>/<call>``, then ``<id>/<call>.<attempt>``;
``<call>`` is the router's random tag and the count of its calls, ``3f9a2c-17``): a
worker still cleaning up a lost attempt, or a call its client cancelled and sent
again at once, never sees the next one as a duplicate, and no late KV frame of the
first (an abort, a layer, its final message) lands in the second's reservation; nor
do two routers' callers that chose the same id meet on a worker they share.

**Prefilled on the decode worker.** Where the prompt is prefilled is decided per
request once the decode worker is picked (disaggregation.py: always on the
prefill pool, never, or by prompt length and the pools' loads). When it is the
decode worker, ``Decode`` asks it to (``prefill_here``): its KvDestination has
no address, there is no Prefill call and no lease, and its first chunk carries
the first token. Failures and migration are those of the decode stream above.
Where the rule may prefill on the decode worker (conditional) and the prefill pool
refuses at its door with no other worker to place on, the request is reserved
again, on the same decode worker where it can, and prefilled there: once a
request, and no migration (nothing was computed or streamed by the lost attempt).

Every worker call carries the client's remaining deadline. However the stream
ends (finished, failed, client cancel or deadline), the worker calls are
cancelled in ``finally``, so the workers free their blocks. A call that fails as
a dead worker does (UNAVAILABLE, or CANCELLED by the server) marks that worker
down at once: no new request goes to it until it answers ``Status`` again. A
worker that is slow or reports a failure of its own is never marked down.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from tandem import logs, wire
from tandem._proto.tandem.v1 import tandem_pb2, worker_pb2
from tandem.config import DisaggregationConfig
from tandem.kv_transfer.base import KV_FAILURE_KEY, NOT_THE_LINK
from tandem.metrics import RouterMetrics
from tandem.router.disaggregation import PrefillRouting
from tandem.router.errors import RouterError
from tandem.router.frontend import PreparedRequest
from tandem.router.placement import PlacementPolicy, Pool
from tandem.router.registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)

Code = grpc.StatusCode
# Codes after which another worker of the pool may take the request: nothing was
# computed (decode) or nothing reached the reservation (prefill).
_RETRY_OPEN = (Code.RESOURCE_EXHAUSTED, Code.UNAVAILABLE)
# Codes that mean the worker process (or our link to it) is gone. CANCELLED here
# was not our doing (ours arrives as asyncio.CancelledError): the server went away.
_DEAD = (Code.UNAVAILABLE, Code.CANCELLED)
# An attempt that ends with one of these after its reservation can be migrated:
# a worker is gone, or the KV transfer between the two failed (ABORTED).
_LOST = (*_DEAD, Code.ABORTED)
# How long a request waits for a call in flight under its id to end before it is
# ALREADY_EXISTS: a cancelled call's clean-up is a task of the event loop's, behind
# whatever else it runs.
REUSE_WAIT_S = 1.0


class AttemptLost(Exception):
    """An attempt failed in a way another attempt may recover from. ``fallback``: the
    prefill pool refused at its door and none of it is left to place on, where the
    rule allows prefilling on the decode worker: the next attempt does that, which is
    no migration (nothing was computed, nothing moves)."""

    def __init__(self, error: RouterError, fallback: bool = False) -> None:
        super().__init__(error.message)
        self.error, self.fallback = error, fallback


class DecodeCapacity:
    """Requests waiting for a decode worker with room, woken one at a time in order.

    ``notify`` is called when room may have appeared (a request released its decode
    worker, a Status poll came back); it wakes the longest waiter, which tries again
    and, if it got a reservation, passes the wake-up on. So a freed slot costs one
    Decode call, not one per waiting request. Requests moving off a lost worker
    (``urgent``) are woken before any new one: their clients hold tokens already.
    """

    def __init__(self) -> None:
        self._urgent: collections.deque[asyncio.Future[None]] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._urgent) + len(self._waiters)

    def notify(self) -> None:
        for line in (self._urgent, self._waiters):
            while line:
                fut = line.popleft()
                if not fut.done():
                    fut.set_result(None)
                    return

    async def wait(self, timeout: float, first: bool = False, urgent: bool = False) -> bool:
        """Wait for a ``notify`` (False after ``timeout`` seconds); ``first``: ahead of
        the others in its line (a request that was woken and still found no room keeps
        its turn); ``urgent``: in the line that is woken first."""
        fut = asyncio.get_running_loop().create_future()
        line = self._urgent if urgent else self._waiters
        if first:
            line.appendleft(fut)
        else:
            line.append(fut)
        try:
            # Not asyncio.wait_for: before Python 3.12 it returns a future that is done
            # when the cancel comes, and a client that left would go on to reserve.
            await asyncio.wait((fut,), timeout=timeout)
            return fut.done()  # woken, even in the turn that the timeout came
        except BaseException:
            if fut.done():  # woken, but leaving: the room goes to the next
                self.notify()
            raise
        finally:
            if not fut.done():
                fut.cancel()
            if fut in line:
                line.remove(fut)


class Relay:
    def __init__(
        self,
        registry: WorkerRegistry,
        policy: PlacementPolicy,
        max_migrations: int = 2,
        queue_timeout_s: float = 120.0,
        prefill_timeout_s: float = 300.0,
        kv_path_cooldown_s: float = 60.0,
        routing: PrefillRouting | None = None,
        metrics: RouterMetrics | None = None,
        prefix_cache_across_keys: bool = False,
    ) -> None:
        self.registry = registry
        registry.on_forget = policy.forget
        self.prefix_cache_across_keys = prefix_cache_across_keys
        self.metrics = metrics or RouterMetrics("")
        # "worker full" retries: a line per request under load (flushed at stop).
        self.full = logs.Throttle(log)
        self.policy = policy
        self.routing = routing or PrefillRouting(DisaggregationConfig())
        self.max_migrations = max_migrations
        self.queue_timeout_s = queue_timeout_s
        self.prefill_timeout_s = prefill_timeout_s
        self.kv_path_cooldown_s = kv_path_cooldown_s
        # (prefill worker, KV destination) -> when a transfer between them failed.
        self._failed_paths: dict[tuple[str, str], float] = {}
        self.capacity = DecodeCapacity()
        self.migrations = 0  # attempts that took over a lost one on a new worker, since start
        # Worker ids (PreparedRequest.worker_id) in flight, each with its end.
        self._active: dict[str, asyncio.Event] = {}
        # The <call> of the workers' request ids: this router's tag and a count.
        self.call_tag = secrets.token_hex(3)
        self._calls = itertools.count()

    async def generate(
        self, req: PreparedRequest, timeout: float | None, arrived: float | None = None
    ) -> AsyncIterator[tandem_pb2.GenerateResponse]:
        """``timeout``: the client's remaining time in seconds (None: no deadline);
        ``arrived``: when the request reached the router (monotonic; default: now), for
        its queue time."""
        arrived = time.monotonic() if arrived is None else arrived
        deadline = None if timeout is None else time.monotonic() + timeout
        await self._claim(req)
        ended = self._active[req.worker_id] = asyncio.Event()
        try:
            if self.routing.needs_prefill_pool and not await self._any_placeable(
                Pool.PREFILL, deadline
            ):
                raise self._none_available(Pool.PREFILL)
            # aclosing: a stream closed early must run the inner finally (cancel, release) now.
            async with aclosing(self._run(req, deadline, arrived)) as responses:
                async for response in responses:
                    yield response
        finally:
            del self._active[req.worker_id]
            ended.set()

    async def _claim(self, req: PreparedRequest) -> None:
        """Wait (``REUSE_WAIT_S`` at most) for a call in flight with this request's id
        to end, else ALREADY_EXISTS: a request id is unique among a key's requests in
        flight (the workers' ids are unique per call anyway). A client that cancels
        and sends the id again at once finds the first call ending (its clean-up runs
        when the router gets to it), not in flight."""
        limit = asyncio.get_running_loop().time() + REUSE_WAIT_S
        while (holder := self._active.get(req.worker_id)) is not None:
            try:
                async with asyncio.timeout_at(limit):
                    await holder.wait()
            except TimeoutError:
                raise RouterError(
                    Code.ALREADY_EXISTS, f"request_id {req.request_id!r} is already in flight"
                ) from None

    async def _run(
        self, req: PreparedRequest, deadline: float | None, arrived: float
    ) -> AsyncIterator[tandem_pb2.GenerateResponse]:
        streamed: list[int] = []  # output tokens the client has, across attempts
        avoid: list[Worker] = []  # the workers of lost attempts
        # Whether the first attempt's prompt was prefilled on the prefill pool (computed
        # whole): a move prefilled on a windowed decode worker computes it so too.
        shipped: list[bool] = []
        migrations, tries, fell_back, takeover = 0, 0, False, False
        call = f"{req.worker_id}/{self.call_tag}-{next(self._calls)}"
        while True:
            worker_id = call if tries == 0 else f"{call}.{tries}"
            worker_req = wire.worker_request(
                worker_id, req.prompt_ids, req.params, streamed, self._cache_salt(req)
            )
            had = len(shipped)
            try:
                queued = arrived if tries == 0 else None
                tries += 1
                attempt_out = self._attempt(
                    req, worker_req, streamed, deadline, queued, avoid, shipped, takeover
                )
                async with aclosing(attempt_out) as out:
                    async for response in out:
                        yield response
                return
            except AttemptLost as lost:
                if lost.fallback and not fell_back:  # once: a pool that flaps migrates
                    fell_back, takeover = True, False
                    del shipped[had:]  # it was not prefilled there after all
                    log.info("request %s: %s; prefilling on the decode worker instead",
                             req.request_id, lost.error.message)  # fmt: skip
                    continue
                if migrations == self.max_migrations:
                    raise lost.error from None
                migrations, takeover = migrations + 1, True
                log.warning(
                    "request %s: %s; migrating after %d tokens (attempt %d of %d)",
                    req.request_id, lost.error.message, len(streamed), migrations + 1,
                    self.max_migrations + 1,
                )  # fmt: skip

    async def _attempt(
        self,
        req: PreparedRequest,
        worker_req: worker_pb2.WorkerRequest,
        streamed: list[int],
        deadline: float | None,
        queued_since: float | None,
        avoid: list[Worker],
        shipped: list[bool],
        takeover: bool = False,
    ) -> AsyncIterator[tandem_pb2.GenerateResponse]:
        """One decode reservation and one prefill (on the prefill pool, or on the decode
        worker itself); appends each relayed token to ``streamed``. Raises AttemptLost
        once the reservation exists, having added the workers it called to ``avoid``
        (which it places on only when their pool has no other). ``queued_since``: the
        first attempt's arrival; None for a later one, which ``takeover`` says is a
        migration (not a fallback, AttemptLost)."""
        migrating = queued_since is None
        decode, stream, destination = await self._open_decode(
            worker_req, deadline, avoid, migrating, prompt_whole=bool(shipped and shipped[0])
        )
        used = [decode]
        if takeover:
            self.migrations += 1
        if queued_since is not None:
            self.metrics.queue_time.observe(time.monotonic() - queued_since)
        here = not destination.address  # the decode worker prefills: no KV to ship
        if not shipped:
            shipped.append(not here)
        renewing = None if here else asyncio.ensure_future(self._renew_lease(decode, destination))
        shipped: asyncio.Future[None] | None = None
        doubtful = False
        try:
            if not here:
                prefill = worker_pb2.PrefillRequest(request=worker_req, destination=destination)
                try:
                    worker, call, result, doubtful = await self._prefill(
                        prefill, deadline, avoid, used
                    )
                except RouterError as exc:
                    if (
                        exc.code in _LOST
                        and not self.routing.needs_prefill_pool
                        and not (
                            await self.registry.any_placeable(Pool.PREFILL, 0)  # now: not waiting
                        )
                    ):
                        raise AttemptLost(exc, fallback=True) from None
                    if exc.code is Code.INTERNAL:
                        # A failed engine step on the prefill worker, which fails every
                        # request of its batch: nothing was streamed, and the request
                        # goes on elsewhere, as after a decode engine's failure.
                        raise AttemptLost(exc) from None
                    raise await self._lost_or(exc, deadline) from None
                # The rest of the call: the KV's way to the decode worker, then its end.
                shipped = self._start_shipped(worker, call, prefill, renewing)
                streamed.append(result.first_token_id)
                first = _response(req, [result.first_token_id], result.text, result.finish_reason,
                                  [result.first_logprob] if result.HasField("first_logprob")
                                  else ())  # fmt: skip
                if result.finish_reason:
                    _set_usage(first, req, len(streamed), len(streamed))
                yield first
                if result.finish_reason:
                    return
            if shipped is not None and doubtful:
                # A worker that went away may have shipped its KV and its own first
                # token before it did: then the decode worker continues from that token,
                # not from the one the client has (they differ when sampling is not
                # seeded), and refuses this transfer. Only this prefill's ack says that
                # the decode worker continues from what the client has.
                await asyncio.wait((shipped,))
                if shipped.exception() is not None:
                    raise await self._lost_or(shipped.exception(), deadline)
            responses = self._relay_decode(
                req, decode, stream, streamed, shipped, deadline, worker_req.request_id
            )
            async with aclosing(responses):
                async for response in responses:
                    yield response
            if shipped is not None:
                # Served: the decode worker had the KV, so the Prefill call only has its
                # ack left; let it end by itself rather than have the worker drop a sent
                # transfer.
                shipped.add_done_callback(_log_late_failure)
                shipped = None
        except AttemptLost as lost:
            avoid.extend(used[1:] if lost.fallback else used)  # (a fallback keeps its decode)
            raise
        finally:
            if renewing is not None:
                renewing.cancel()
            if shipped is not None:
                shipped.cancel()  # if still open, the worker drops the transfer
                shipped.add_done_callback(_retrieved)  # its error, if any, is moot now
            stream.cancel()  # no-op once finished; otherwise the worker frees its blocks
            decode.prefilling.pop(worker_req.request_id, None)
            self.registry.release(decode)
            self.capacity.notify()

    async def _lost_or(self, exc: RouterError, deadline: float | None) -> Exception:
        """``exc`` as AttemptLost when another attempt may recover (not when no prefill
        worker is left: another attempt would fail the same), else ``exc`` itself."""
        if exc.code in _LOST and (
            not self.routing.needs_prefill_pool or await self._any_placeable(Pool.PREFILL, deadline)
        ):
            return AttemptLost(exc)
        return exc

    async def _open_decode(
        self,
        worker_req: worker_pb2.WorkerRequest,
        deadline: float | None,
        avoid: list[Worker],
        migrating: bool = False,
        prompt_whole: bool = False,
    ) -> tuple[Worker, grpc.aio.UnaryStreamCall, worker_pb2.KvDestination]:
        """A decode reservation, waiting in line for room when every worker is full. A
        ``migrating`` request (its client may hold tokens already) waits in a line of
        its own that is woken first: room goes to a lost worker's requests before
        newcomers."""
        queued_at: float | None = None
        if self.capacity.waiting and not migrating:  # others wait already: behind them
            queued_at = time.monotonic()
            await self._wait_for_room(queued_at, deadline, False, "requests queued ahead")
        while True:
            try:
                # Inside: a woken request that finds no decode worker left (or whose
                # client leaves while it waits for a poll round) wakes the next in line,
                # which must not wait out queue_timeout_s to hear the same.
                if not await self._any_placeable(Pool.DECODE, deadline):
                    raise self._none_available(Pool.DECODE)
                opened, error = await self._try_decode(worker_req, deadline, avoid, prompt_whole)
            except BaseException:  # its client left, or it failed, with the room it woke for
                if queued_at is not None:
                    self.capacity.notify()  # the next in line takes it
                raise
            if opened is not None:
                if queued_at is not None:
                    self.capacity.notify()  # room for us: maybe for the next one too
                return opened
            if error is None or error.code is not Code.RESOURCE_EXHAUSTED:
                if queued_at is not None:
                    self.capacity.notify()  # the room it woke for: the next in line's
                raise error or self._none_available(Pool.DECODE)
            # Every decode worker tried is full: wait for room, in order (a request
            # that was woken and still found none keeps its place at the front).
            first = queued_at is not None
            queued_at = queued_at or time.monotonic()
            await self._wait_for_room(queued_at, deadline, first, error.message, migrating)

    async def _wait_for_room(
        self,
        queued_at: float,
        deadline: float | None,
        first: bool,
        why: str,
        urgent: bool = False,
    ) -> None:
        now = time.monotonic()
        left = self.queue_timeout_s - (now - queued_at)
        if deadline is not None:
            left = min(left, deadline - now)
        if left > 0 and await self.capacity.wait(left, first, urgent):
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise RouterError(
                Code.DEADLINE_EXCEEDED,
                "the deadline passed while waiting for a decode worker with room",
            )
        raise RouterError.overloaded(
            f"no decode worker had room within queue_timeout_s={self.queue_timeout_s:g} s "
            f"({why}); retry later",
            reason="decode_queue_timeout",
        )

    async def _try_decode(
        self,
        worker_req: worker_pb2.WorkerRequest,
        deadline: float | None,
        avoid: list[Worker],
        prompt_whole: bool = False,
    ) -> tuple[tuple[Worker, grpc.aio.UnaryStreamCall, worker_pb2.KvDestination] | None,
               RouterError | None]:  # fmt: skip
        """Decode workers in turn, each once; (opened, None) or (None, the error: a full
        worker's if one was, so that the caller waits for room). Not only the first
        that refuse: placement ranks workers by their free KV, and workers at
        ``max_num_seqs`` with short sequences have the most, while others have room. A worker
        found dead is marked down and does not count: a crashed host's workers must not
        use up the tries while a live one is free. ``prompt_whole``: a prompt prefilled
        on the decode worker is computed as the prefill pool computed it before (see
        LLMEngine.prefill_here). Where the prompt is prefilled is
        decided for the worker picked (disaggregation.py)."""
        tried: list[Worker] = []
        error: RouterError | None = None
        full: RouterError | None = None
        tokens = [*worker_req.prompt_token_ids, *worker_req.output_token_ids]
        while True:
            candidates = self._candidates(Pool.DECODE, tried, avoid)
            if not candidates:
                break
            if tried:  # the last one failed at its door: given to another
                self.metrics.retried(Pool.DECODE.value)
            worker = self._pick(Pool.DECODE, candidates, tokens, worker_req.cache_salt)
            # This pick's: others' may come while we wait.
            cached, noted = self.policy.cached_tokens, self.policy.noted
            tried.append(worker)
            moved = bool(worker_req.output_token_ids)
            if moved and not worker.kv_block_size:  # added since the last poll: its window
                await self.registry.poll_now(worker)  # decides where a move is prefilled
                if not worker.healthy or worker.removed:
                    self.policy.refused(noted)
                    continue
            timeout = _remaining(deadline)
            prefill = [w.load() for w in self.registry.placeable(Pool.PREFILL)]
            # What the worker would have to compute if it prefilled: less its cached prefix.
            to_compute = len(tokens) - cached
            decision = self.routing.decide(to_compute, prefill, worker.load(), moved)
            self.registry.acquire(worker)
            request = worker_pb2.DecodeRequest(
                request=worker_req,
                prefill_here=decision.here,
                prompt_whole=decision.here and prompt_whole,
            )
            stream = worker.stub.Decode(request, timeout=timeout)
            try:
                first = await stream.read()
            except grpc.aio.AioRpcError as exc:
                self.registry.release(worker)
                self.policy.refused(noted)  # it holds nothing of the request
                error = self._failed(worker, exc)
                if exc.code() in _RETRY_OPEN:
                    if exc.code() is Code.RESOURCE_EXHAUSTED:  # a line per worker at most
                        self.full.log(logging.INFO, "request %s: %s", worker_req.request_id,
                                      error.message, kind=worker.address)  # fmt: skip
                    else:
                        log.info("request %s: %s", worker_req.request_id, error.message)
                    if exc.code() is Code.RESOURCE_EXHAUSTED:
                        full = error
                    continue
                raise error from None
            except BaseException:
                stream.cancel()
                self.registry.release(worker)
                raise
            if (
                first is grpc.aio.EOF
                or not first.HasField("destination")
                or decision.here != (not first.destination.address)
            ):
                stream.cancel()
                self.registry.release(worker)
                raise RouterError(
                    Code.INTERNAL,
                    f"decode worker {worker.address} did not open its stream with a "
                    f"KvDestination {'without' if decision.here else 'with'} an address",
                )
            self.registry.reserved(worker, len(first.destination.block_ids))
            self.policy.holds(Pool.DECODE, worker.address, tokens, worker_req.cache_salt)
            self.routing.count(decision)
            if decision.here:  # until its first token is back (_relay_decode, _attempt)
                worker.prefilling[worker_req.request_id] = max(0, to_compute)
            return (worker, stream, first.destination), None
        return None, full or error

    async def _renew_lease(self, decode: Worker, destination: worker_pb2.KvDestination) -> None:
        """While the prefill runs (or waits in a busy prefill worker's queue), keep the
        reservation's lease from running out: this router still wants the KV."""
        every = max(0.05, destination.lease_seconds / 3)
        request = worker_pb2.RenewLeaseRequest(request_id=destination.request_id)
        while True:
            await asyncio.sleep(every)
            try:
                reply = await decode.stub.RenewLease(request, timeout=every)
            except grpc.aio.AioRpcError as exc:  # the decode stream reports a dead worker
                log.debug("renewing %s on %s: %s", request.request_id, decode.address, exc)
                continue
            if not reply.renewed:  # arrived or failed: nothing left to keep alive
                return

    async def _prefill(
        self,
        request: worker_pb2.PrefillRequest,
        deadline: float | None,
        avoid: list[Worker],
        used: list[Worker],
    ) -> tuple[Worker, grpc.aio.UnaryStreamCall, worker_pb2.PrefillResponse, bool]:
        """The prefill worker, its still open call, the call's first response (the first
        token), and whether an earlier worker tried may have shipped its KV before it
        failed (it went away rather than refusing at its door). The worker stays
        acquired until ``_start_shipped``'s task ends the call. Each worker called is
        added to ``used``."""
        tried: list[Worker] = []
        error: RouterError | None = None
        doubtful = False
        tokens = [*request.request.prompt_token_ids, *request.request.output_token_ids]
        avoid = [*avoid, *self._failed_path_senders(request.destination.address)]
        while True:
            candidates = self._candidates(Pool.PREFILL, tried, avoid)
            if not candidates:
                raise error or self._none_available(Pool.PREFILL)
            if tried:  # the last one failed at its door: given to another
                self.metrics.retried(Pool.PREFILL.value)
            worker = self._pick(Pool.PREFILL, candidates, tokens, request.request.cache_salt)
            noted = self.policy.noted
            tried.append(worker)
            used.append(worker)
            timeout = _remaining(deadline)
            self.registry.acquire(worker)
            call = worker.stub.Prefill(request, timeout=timeout)
            try:
                first = await _read_within(call, self.prefill_timeout_s or None)
            except TimeoutError:
                call.cancel()
                self.registry.release(worker)
                # Busy or stalled, it is not taken for dead, and no other attempt is
                # made: overload is RESOURCE_EXHAUSTED; the reservation goes back.
                raise RouterError.overloaded(
                    f"prefill worker {worker.address} gave no first token within "
                    f"prefill_timeout_s={self.prefill_timeout_s:g} s; retry later",
                    reason="prefill_timeout",
                ) from None
            except grpc.aio.AioRpcError as exc:
                self.registry.release(worker)
                self.policy.refused(noted)  # no first token: what it computed is not known
                error = self._prefill_failed(worker, request, exc)
                doubtful = doubtful or exc.code() is not Code.RESOURCE_EXHAUSTED
                # Gone or busy: one other worker may serve the reservation (see above).
                if exc.code() in _RETRY_OPEN and len(tried) < 2:
                    if exc.code() is Code.RESOURCE_EXHAUSTED:  # a line per worker at most
                        self.full.log(logging.INFO, "request %s: %s",
                                      request.request.request_id, error.message,
                                      kind=worker.address)  # fmt: skip
                    else:
                        log.info("request %s: %s", request.request.request_id, error.message)
                    continue
                raise error from None
            except BaseException:
                call.cancel()
                self.registry.release(worker)
                raise
            if first is grpc.aio.EOF:
                call.cancel()
                self.registry.release(worker)
                raise RouterError(
                    Code.INTERNAL, f"prefill worker {worker.address} ended Prefill with no token"
                )
            self.policy.holds(Pool.PREFILL, worker.address, tokens, request.request.cache_salt)
            return worker, call, first, doubtful

    def _start_shipped(
        self,
        worker: Worker,
        call: grpc.aio.UnaryStreamCall,
        request: worker_pb2.PrefillRequest,
        renewing: asyncio.Future[None],
    ) -> asyncio.Future[None]:
        """``_shipped`` as a task. Its clean-up is the task's done callback, which runs
        even for a task cancelled before its first step (a finally in it would not):
        the lease stops being renewed, the call is cancelled if still open, and the
        prefill worker released."""

        def end(_: asyncio.Future[None]) -> None:
            renewing.cancel()  # the KV is there or never will be: nothing to keep alive
            if not call.done():
                call.cancel()
            self.registry.release(worker, shipping=True)

        self.registry.shipping(worker)
        shipped = asyncio.ensure_future(self._shipped(worker, call, request))
        shipped.add_done_callback(end)
        return shipped

    async def _shipped(
        self,
        worker: Worker,
        call: grpc.aio.UnaryStreamCall,
        request: worker_pb2.PrefillRequest,
    ) -> None:
        """Wait for the Prefill call's end: the decode side has the KV (or the first token
        ended the request). Raises the RouterError of a call that fails. Run it with
        ``_start_shipped``, whose done callback ends the call."""
        try:
            while await call.read() is not grpc.aio.EOF:  # the KV's outcome: not needed here
                pass
        except grpc.aio.AioRpcError as exc:
            raise self._prefill_failed(worker, request, exc) from None

    def _prefill_failed(
        self, worker: Worker, request: worker_pb2.PrefillRequest, exc: grpc.aio.AioRpcError
    ) -> RouterError:
        if exc.code() is Code.ABORTED:  # the KV never reached the decode worker
            reason = dict(exc.trailing_metadata() or ()).get(KV_FAILURE_KEY)
            if reason not in NOT_THE_LINK:
                self._path_failed(worker.address, request.destination.address)
            return RouterError.unavailable(
                f"KV transfer from prefill worker {worker.address} to decode worker "
                f"{request.destination.address} failed: {exc.details()}"
            )
        return self._failed(worker, exc)

    async def _relay_decode(
        self,
        req: PreparedRequest,
        worker: Worker,
        stream: grpc.aio.UnaryStreamCall,
        streamed: list[int],
        shipped: asyncio.Future[None] | None,
        deadline: float | None,
        worker_id: str = "",
    ) -> AsyncIterator[tandem_pb2.GenerateResponse]:
        """``shipped``: the Prefill call's end (None: the decode worker prefills);
        ``worker_id``: the request's id on the worker."""
        # The first chunk comes once the KV has arrived: until then, a Prefill call
        # that fails means it never will (the decode worker would only see its lease
        # run out).
        first: asyncio.Future | None = asyncio.ensure_future(stream.read())
        if shipped is not None:
            try:
                await asyncio.wait((first, shipped), return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                first.cancel()
                raise
            if not first.done() and shipped.exception() is not None:
                first.cancel()
                raise await self._lost_or(shipped.exception(), deadline)
        while True:
            try:
                message = await (first or stream.read())
                if first is not None:  # its prefill, if it had one here, is done
                    worker.prefilling.pop(worker_id, None)
                first = None
            except grpc.aio.AioRpcError as exc:
                error = self._failed(worker, exc)
                if exc.code() in _LOST:
                    raise AttemptLost(error) from None
                raise error from None
            if message is grpc.aio.EOF:
                raise AttemptLost(
                    RouterError.unavailable(
                        f"decode worker {worker.address} ended the stream before the request "
                        "finished"
                    )
                )
            if not message.HasField("chunk"):
                raise RouterError(
                    Code.INTERNAL, f"decode worker {worker.address} sent a second KvDestination"
                )
            chunk = message.chunk
            if chunk.finish_reason == tandem_pb2.FINISH_REASON_ERROR:
                # A failed engine step (its device still works, or the worker would have
                # exited): the request goes on elsewhere, from what the client has.
                raise AttemptLost(RouterError(
                    Code.INTERNAL, f"decode worker {worker.address} failed the request in "
                    "its engine",
                ))  # fmt: skip
            streamed.extend(chunk.token_ids)
            response = _response(req, chunk.token_ids, chunk.text, chunk.finish_reason,
                                 chunk.logprobs)  # fmt: skip
            if chunk.finish_reason:
                # The worker's count includes tokens it held back (a stop string).
                _set_usage(response, req, chunk.completion_tokens, len(streamed))
                self.policy.holds(
                    Pool.DECODE, worker.address, [*req.prompt_ids, *streamed], self._cache_salt(req)
                )
                yield response
                return
            yield response

    def _path_failed(self, sender: str, destination: str) -> None:
        if self.kv_path_cooldown_s:
            now = time.monotonic()
            self._failed_paths = {
                path: at
                for path, at in self._failed_paths.items()
                if now - at < self.kv_path_cooldown_s
            }
            self._failed_paths[(sender, destination)] = now

    def _failed_path_senders(self, destination: str) -> list[Worker]:
        """The prefill workers whose transfer to ``destination`` failed within
        ``kv_path_cooldown_s``: placed on only when their pool has no other."""
        now = time.monotonic()
        senders = {
            sender
            for (sender, to), at in self._failed_paths.items()
            if to == destination and now - at < self.kv_path_cooldown_s
        }
        return [w for w in self.registry.workers(Pool.PREFILL) if w.address in senders]

    def _candidates(self, pool: Pool, tried: list[Worker], avoid: list[Worker]) -> list[Worker]:
        """The placeable workers not tried yet, less those of lost attempts unless they
        are all there is."""
        fresh = self.registry.placeable(pool, exclude=tried)
        return [w for w in fresh if w not in avoid] or fresh

    def _pick(self, pool: Pool, candidates: list[Worker], token_ids, cache_salt: str) -> Worker:
        by_address = {w.address: w for w in candidates}
        loads = [w.load() for w in candidates]
        return by_address[self.policy.pick(pool, loads, token_ids, cache_salt).address]

    def _cache_salt(self, req: PreparedRequest) -> str:
        """The workers' prefix-cache namespace for ``req``: its API key's, so that a
        key's caller cannot tell from its time to first token whether a prompt was
        recently sent under another key (unless ``prefix_cache_across_keys``)."""
        return "" if self.prefix_cache_across_keys else req.tenant

    def _failed(self, worker: Worker, exc: grpc.aio.AioRpcError) -> RouterError:
        """The client's status for a failed worker call; a dead worker is marked down."""
        code, details = exc.code(), exc.details()
        where = f"{worker.pool.value} worker {worker.address}"
        if code in _DEAD:
            self.registry.mark_down(worker, f"{code.name}: {details}")
            return RouterError.unavailable(f"{where} is unavailable: {details}")
        if code is Code.ABORTED:  # the worker is fine; the KV transfer failed
            return RouterError.unavailable(f"{where}: {details}")
        if code is Code.DEADLINE_EXCEEDED:
            return RouterError(code, f"the deadline passed while waiting for {where}")
        return RouterError(code, f"{where}: {details}")

    async def _any_placeable(self, pool: Pool, deadline: float | None) -> bool:
        """A worker down only because a call to it failed may be back at the next poll:
        worth that short wait before telling the client that the pool has none."""
        wait = 2 * self.registry.status_interval_s + 2.0  # a poll round, with a slow Status
        if deadline is not None:
            wait = min(wait, max(0.0, deadline - time.monotonic()))
        return await self.registry.any_placeable(pool, wait)

    def _none_available(self, pool: Pool) -> RouterError:
        total = len(self.registry.workers(pool))
        why = f"all {total} registered are down" if total else "none is registered"
        return RouterError.unavailable(f"no {pool.value} worker is available ({why})")


async def _read_within(call: grpc.aio.UnaryStreamCall, timeout: float | None):
    """``call.read()``, or asyncio.TimeoutError after ``timeout`` seconds (None: no
    bound). Not asyncio.wait_for, which before Python 3.12 can return a message that
    came in the turn that a cancel did, and lose the cancel."""
    if timeout is None:
        return await call.read()
    read = asyncio.ensure_future(call.read())
    read.add_done_callback(_retrieved)  # an error of a read given up on is moot
    try:
        await asyncio.wait((read,), timeout=timeout)
    except BaseException:
        read.cancel()
        raise
    if not read.done():
        read.cancel()
        raise TimeoutError
    return read.result()


def _response(
    req: PreparedRequest, token_ids, text: str, finish_reason: int, logprobs=()
) -> tandem_pb2.GenerateResponse:
    response = tandem_pb2.GenerateResponse(
        request_id=req.request_id, text=text, token_ids=token_ids, logprobs=logprobs
    )
    if finish_reason:
        response.finish_reason = finish_reason
    return response


def _set_usage(
    response: tandem_pb2.GenerateResponse, req: PreparedRequest, reported: int, streamed: int
) -> None:
    """Usage on the last response: the client's prompt (not a migration's longer one) and
    every output token, by the worker's count when it gives one (it counts tokens it
    held back, a stop string), else by what was streamed."""
    response.usage.prompt_tokens = len(req.prompt_ids)
    response.usage.completion_tokens = reported or streamed


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _log_late_failure(shipped: asyncio.Future[None]) -> None:
    if not shipped.cancelled() and shipped.exception() is not None:
        log.info("after its request was served: %s", shipped.exception())


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise RouterError(Code.DEADLINE_EXCEEDED, "the deadline passed before the call was made")
    return left
