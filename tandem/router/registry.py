"""The router's view of its workers: membership, health and load.

Workers are given at start (``RouterConfig.prefill_workers`` / ``decode_workers``)
and can be added and removed while the router runs (``add_worker`` /
``remove_worker``). Each has one gRPC channel, reused by every request: mutual
TLS with the cluster's credentials when the router has them (the worker checks
our member certificate, we check its), plaintext otherwise.

A worker is *placeable* while it is healthy. A busy worker is not a dead one:
it stops being healthy only on evidence of death,
- its ``Status`` (polled every ``status_interval_s``) fails with UNAVAILABLE: the
  connection was refused or reset, or keepalive found it silent; a draining
  worker refuses new calls this way too, so it leaves placement at once;
- its ``Status`` has gone unanswered (DEADLINE_EXCEEDED and the like, the
  connection up) for ``worker_timeout_s``: a hung process. Workers answer Status
  from a snapshot, never behind the engine, so a slow answer is not this;
- a request's call to it failed as a dead worker does (``mark_down``);
and it becomes healthy again at its next successful ``Status``. Load is what
placement weighs: a slow worker has a longer queue and gets less.

Load: each poll stores the worker's numbers, and how many calls this router had
there (``active_at_poll``); between polls the change in that count is what the
numbers lack: calls placed since (a burst counts as load at once) and calls ended
since (a worker polled mid-request is idle again once it ends, not at the next
poll). Calls that start or end while a Status is on its way may or may not be in
its numbers: the count taken is the larger of those as it was asked and answered,
so a call placed then is not counted twice, and one ended then is left out. The
numbers may also lack calls sent during the worker's current engine step (it
answers with those from before it), so a worker's queue and running together are
never taken as less than this router has in flight there (less, on a prefill
worker, the calls whose first token is back and whose KV is only being shipped);
KV blocks named in destinations since the poll are taken off its free blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import grpc

from tandem._proto.tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.router.placement import DEFAULT_BLOCK_SIZE, Pool, WorkerLoad
from tandem.security.cluster import ClusterCredentials

log = logging.getLogger(__name__)

_ROLES = {Pool.PREFILL: worker_pb2.ROLE_PREFILL, Pool.DECODE: worker_pb2.ROLE_DECODE}


@dataclass(eq=False)
class Worker:
    address: str
    pool: Pool
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub
    last_ok: float  # monotonic time of the last successful Status (or of registration)
    healthy: bool = True  # optimistic until Status says otherwise: serves at once
    removed: bool = False
    # Last polled numbers.
    queue_depth: int = 0
    running: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    kv_block_size: int = 0  # tokens per block (0: not reported yet)
    kv_window_tokens: int = 0
    prefix_cache_max_tokens: int = 0
    prefill_token_seconds: float = 0.0
    worker_id: str = ""
    metrics_address: str = ""  # where Prometheus scrapes it ("": off)
    prefix_query_tokens: int = 0  # since the worker started: a drop means it restarted
    # This router's own counts.
    inflight: int = 0
    # Prefill workers: calls whose first token is back and whose KV is still on its way
    # (the worker computes nothing more for them).
    shipping: int = 0
    # This router's calls the worker was computing for (inflight - shipping) when its
    # last Status was asked for: the change since is what its numbers lack.
    active_at_poll: int = 0
    reserved_since_poll: int = 0  # decode: KV blocks named in destinations since the poll
    # Decode: this router's requests it prefills itself whose first token is not back
    # yet (request id -> tokens to compute): one step will compute them together.
    prefilling: dict[str, int] = field(default_factory=dict)
    closing: list[asyncio.Task] = field(default_factory=list)
    polling: asyncio.Future | None = None  # its Status call on its way, if one is

    def load(self) -> WorkerLoad:
        # A worker's Status numbers are a snapshot: calls this router made since are not
        # in them, and calls of its that ended since still are. Without the second, a
        # worker polled mid-request looked busy until the next poll after the request
        # was done, and short requests in a row all went to the other workers.
        active = self.inflight - self.shipping
        change = active - self.active_at_poll
        queue, running = self.queue_depth + max(0, change), self.running
        if change < 0:  # ended since the poll: they were running (or, failing, queued)
            running = max(0, running + change)
            queue = max(0, queue - max(0, -change - self.running))
        # The numbers also date from before the worker's current engine step, and the
        # requests sent during that step are not in them: a poll must not erase them,
        # or a worker in a long step (a long prompt's prefill) looks empty after every
        # poll and takes nearly every request. What this router has in flight there is
        # a floor on its load.
        queue += max(0, active - queue - running)
        return WorkerLoad(
            address=self.address,
            queue_depth=queue,
            running=running,
            kv_blocks_free=max(0, self.kv_blocks_free - self.reserved_since_poll),
            inflight=self.inflight,
            kv_blocks_total=self.kv_blocks_total,
            kv_block_size=self.kv_block_size or DEFAULT_BLOCK_SIZE,
            kv_window_tokens=self.kv_window_tokens,
            prefix_cache_max_tokens=self.prefix_cache_max_tokens,
            prefill_token_seconds=self.prefill_token_seconds,
            prefilling=len(self.prefilling),
            prefilling_tokens=sum(self.prefilling.values()),
        )


class WorkerRegistry:
    def __init__(
        self,
        status_interval_s: float,
        worker_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        channel_options: list[tuple[str, int]] | None = None,
        credentials: ClusterCredentials | None = None,
    ) -> None:
        self.status_interval_s = status_interval_s
        self.channel_options = list(channel_options or [])
        self.credentials = credentials
        if credentials is not None:
            self.channel_options += credentials.channel_options()
        self.worker_timeout_s = worker_timeout_s
        self._clock = clock
        self._workers: dict[tuple[Pool, str], Worker] = {}
        self._poller: asyncio.Task | None = None
        self._polled: asyncio.Event | None = None  # set after each poll round, then replaced
        # Called with (pool, address) when what a worker held may be gone: it went
        # down, restarted or was removed (the placement policy forgets its history).
        self.on_forget: Callable[[Pool, str], None] = lambda pool, address: None

    # Membership ----------------------------------------------------------------

    def add_worker(self, pool: Pool | str, address: str) -> None:
        """Adds a worker (idempotent); it takes requests at once."""
        pool = Pool(pool)
        if (pool, address) in self._workers:
            return
        if self.credentials is None:
            channel = grpc.aio.insecure_channel(address, options=self.channel_options)
        else:
            channel = grpc.aio.secure_channel(
                address, self.credentials.channel_credentials(), options=self.channel_options
            )
        stub_cls = (
            worker_pb2_grpc.PrefillWorkerStub
            if pool is Pool.PREFILL
            else worker_pb2_grpc.DecodeWorkerStub
        )
        self._workers[(pool, address)] = Worker(
            address, pool, channel, stub_cls(channel), last_ok=self._clock()
        )
        log.info("added %s worker %s", pool.value, address)

    def remove_worker(self, pool: Pool | str, address: str) -> bool:
        """Stops placing on the worker; its channel closes when its last request ends."""
        worker = self._workers.pop((Pool(pool), address), None)
        if worker is None:
            return False
        worker.removed = True
        self.on_forget(worker.pool, address)
        if worker.inflight == 0:
            self._close(worker)
        log.info("removed %s worker %s", worker.pool.value, address)
        return True

    def workers(self, pool: Pool | None = None) -> list[Worker]:
        # A copy first (one C call, whole under the GIL): the metrics endpoint's thread
        # lists the workers while the event loop adds and removes them.
        return [w for w in list(self._workers.values()) if pool is None or w.pool is pool]

    def placeable(self, pool: Pool, exclude: Iterable[Worker] = ()) -> list[Worker]:
        skip = set(map(id, exclude))
        return [w for w in self.workers(pool) if w.healthy and id(w) not in skip]

    def sequence_capacity(self, pool: Pool) -> int | None:
        """The most tokens one sequence may hold on every placeable worker of ``pool``
        that has reported its KV pool (its blocks x tokens per block); None when none
        has. A worker with a KV window is bounded by the window, not by its pool."""
        held = [w.kv_blocks_total * w.kv_block_size for w in self.placeable(pool)
                if w.kv_blocks_total and w.kv_block_size and not w.kv_window_tokens]  # fmt: skip
        return min(held, default=None)

    async def any_placeable(self, pool: Pool, timeout: float) -> bool:
        """Whether ``pool`` has a placeable worker; when every registered one is down,
        after the next poll round (one marked down by a failed call but alive answers
        its Status again), waiting at most ``timeout`` seconds."""
        if self.placeable(pool) or not self.workers(pool):
            return bool(self.placeable(pool))
        if self._polled is None:
            self._polled = asyncio.Event()
        try:
            await asyncio.wait_for(asyncio.shield(self._polled.wait()), timeout)
        except TimeoutError:
            pass
        return bool(self.placeable(pool))

    # Per-request accounting --------------------------------------------------------

    def acquire(self, worker: Worker) -> None:
        worker.inflight += 1

    def release(self, worker: Worker, shipping: bool = False) -> None:
        """A call has ended (``shipping``: one that ``shipping`` counted)."""
        worker.inflight -= 1
        worker.shipping -= shipping
        if worker.removed and worker.inflight == 0:
            self._close(worker)

    def shipping(self, worker: Worker) -> None:
        """A prefill worker's call has its first token back: its engine is done with
        it, and only the KV is on its way (until ``release(worker, shipping=True)``)."""
        worker.shipping += 1

    def reserved(self, worker: Worker, num_blocks: int) -> None:
        worker.reserved_since_poll += num_blocks

    def mark_down(self, worker: Worker, reason: str) -> None:
        if worker.healthy:
            log.warning("%s worker %s is down: %s", worker.pool.value, worker.address, reason)
            self.on_forget(worker.pool, worker.address)
        worker.healthy = False

    # Status polling ------------------------------------------------------------------

    def start(self, after_poll: Callable[[], Awaitable[None]] | None = None) -> None:
        """Polls every ``status_interval_s``; ``after_poll`` runs after each round."""
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll_forever(after_poll), name="status-poller")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        workers = list(self._workers.values())
        self._workers.clear()
        polls = [w.polling for w in workers if w.polling is not None]
        for poll in polls:  # a move's, which the poller's cancel did not reach
            poll.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        for worker in workers:
            self._close(worker)
        await asyncio.gather(*(t for w in workers for t in w.closing), return_exceptions=True)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self.poll_now(w) for w in self.workers()))
        polled, self._polled = self._polled, None
        if polled is not None:
            polled.set()

    async def _poll_forever(self, after_poll: Callable[[], Awaitable[None]] | None) -> None:
        while True:
            try:
                await self.poll_once()
                if after_poll is not None:
                    await after_poll()
            except Exception:  # one bad round must not end every later one
                log.exception("status poll round failed")
            await asyncio.sleep(self.status_interval_s)

    async def poll_now(self, worker: Worker) -> None:
        """A Status of ``worker`` (each round's, or one now for a worker added since the
        last): the one on its way if there is one, so that answers never land out of order."""
        if worker.polling is None or worker.polling.done():
            worker.polling = asyncio.ensure_future(self._poll_guarded(worker))
        await asyncio.shield(worker.polling)  # a cancelled caller leaves it to the others

    async def _poll_guarded(self, worker: Worker) -> None:
        """``_poll``, with any failure but a failed call (a reply this router cannot
        read: another version's) taking the worker out of placement, not the poller."""
        try:
            await self._poll(worker)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this poll itself is being cancelled
                raise
            # grpc.aio ends a call so when its channel closes: the worker was removed
            # (the poll round, or a move waiting on it, goes on without it).
            if not worker.removed:
                self.mark_down(worker, "its Status call was cancelled (its channel closed)")
        except Exception as exc:
            log.exception("%s worker %s: Status reply not understood", worker.pool.value,
                          worker.address)  # fmt: skip
            self.mark_down(worker, f"Status reply not understood ({exc!r})")

    async def _poll(self, worker: Worker) -> None:
        # Generous: one poll is outstanding per worker, and only the window below counts.
        timeout = min(max(2.0, self.status_interval_s), self.worker_timeout_s)
        # As the call goes (see "Load" above).
        active = worker.inflight - worker.shipping
        try:
            status = await worker.stub.Status(worker_pb2.StatusRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:  # another kind of server there
                self.mark_down(worker, f"it does not serve a {worker.pool.value} worker's Status")
            elif exc.code() is grpc.StatusCode.UNAVAILABLE:  # refused, reset, keepalive, GOAWAY
                self.mark_down(worker, f"Status: UNAVAILABLE: {exc.details()}")
            elif worker.healthy and self._clock() - worker.last_ok > self.worker_timeout_s:
                self.mark_down(
                    worker,
                    f"Status failing for over {self.worker_timeout_s:g} s "
                    f"({exc.code().name}: {exc.details()})",
                )
            return
        if status.role != _ROLES[worker.pool]:
            self.mark_down(
                worker,
                f"it reports role {_role_name(status.role)}, "
                f"but it was registered as a {worker.pool.value} worker",
            )
            return
        # What placement hashed in before this answer (the default before the first).
        block_size = worker.kv_block_size or DEFAULT_BLOCK_SIZE
        if status.prefix_query_tokens < worker.prefix_query_tokens:
            log.info("%s worker %s restarted", worker.pool.value, worker.address)
            self.on_forget(worker.pool, worker.address)
        elif status.kv_block_size and status.kv_block_size != block_size:
            self.on_forget(worker.pool, worker.address)
        worker.kv_block_size = status.kv_block_size
        worker.kv_window_tokens = status.kv_window_tokens
        worker.prefix_cache_max_tokens = status.prefix_cache_max_tokens
        worker.prefix_query_tokens = status.prefix_query_tokens
        worker.queue_depth = status.queue_depth
        worker.worker_id = status.worker_id
        worker.metrics_address = status.metrics_address
        worker.running = status.running
        worker.kv_blocks_free = status.kv_blocks_free
        worker.kv_blocks_total = status.kv_blocks_total
        worker.prefill_token_seconds = status.prefill_token_seconds
        worker.active_at_poll = max(active, worker.inflight - worker.shipping)
        worker.reserved_since_poll = 0
        worker.last_ok = self._clock()
        if not worker.healthy:
            log.info("%s worker %s answers again", worker.pool.value, worker.address)
            worker.healthy = True

    def _close(self, worker: Worker) -> None:
        worker.closing.append(asyncio.ensure_future(worker.channel.close()))


def _role_name(role: int) -> str:
    """The role's name, or its number when this version does not know it."""
    try:
        return worker_pb2.Role.Name(role)
    except ValueError:
        return str(role)
