"""Sends the load and records every request's token timeline.

A run: connect and read the model's limits (``GetModelInfo``); build the dataset
(``Tokenize`` counts prompts as the server does); send the warm-up requests and
wait for them (their results are dropped); then send the measured requests at
the arrival times drawn for the rate (or as fast as the concurrency limit lets
them go) until ``num_requests`` were sent or ``duration_s`` has passed, and wait
for the last one. A request's clock starts when it is sent; when a concurrency
limit holds it back, the wait for a free slot is not part of its latency (as in
vLLM's benchmark).

Multi-turn chats (``multi_turn``): a request that repeats an earlier request's
messages followed by an assistant turn is that conversation's next turn
(``datasets.follow_ups``: a jsonl file's lines, or a ShareGPT conversation's human
turns, whose turns take consecutive arrival slots). It is sent at its arrival time
or once the earlier turn's reply has come, whichever is later, with the reply the
server gave in place of the file's assistant turn, as a user would; the wait is
not part of its latency. A server that caches what it generated can then serve the
whole history from cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import itertools
import logging
import math
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc

from tandem.bench.load import arrivals, datasets
from tandem.bench.load.datasets import LengthDist, RequestSpec
from tandem.bench.load.metrics import SLO, RequestRecord, Summary, summarize
from tandem.client import AsyncTandemClient, ModelInfo
from tandem.client.errors import InvalidRequest, TandemClientError
from tandem.config import check_address
from tandem.errors import InvalidRequestError

log = logging.getLogger(__name__)

# Requests a duration-bounded run prepares up front; past them a file's are sent again
# (cycled), and synthetic ones drawn anew, this many at a time.
DURATION_POOL = 512


@dataclass(frozen=True)
class DatasetConfig:
    kind: str = "synthetic"  # synthetic, jsonl or sharegpt
    path: str | None = None
    input_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 128))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 128))
    # jsonl: output length of lines without "output_len"; sharegpt: replaces the replies'.
    file_output_len: int | None = None
    # jsonl, sharegpt: send the file's requests in its order (cycling when it holds fewer)
    # rather than in a seeded random one: a file of multi-turn chats, whose turns follow
    # each other as their users would send them.
    in_order: bool = False
    # jsonl, sharegpt: send each conversation's turns with the replies the server gave
    # (above); sharegpt: every human turn, not only the first.
    multi_turn: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("synthetic", "jsonl", "sharegpt"):
            raise InvalidRequestError(
                "dataset", f"--dataset must be synthetic, jsonl or sharegpt, got {self.kind!r}"
            )
        if self.in_order and self.kind == "synthetic":
            raise InvalidRequestError(
                "dataset", "--dataset-in-order is for jsonl and sharegpt files"
            )
        if self.multi_turn and self.kind == "synthetic":
            raise InvalidRequestError("dataset", "--multi-turn is for jsonl and sharegpt files")
        if self.multi_turn and self.kind == "jsonl" and not self.in_order:
            raise InvalidRequestError(
                "dataset",
                "--multi-turn with a jsonl file needs --dataset-in-order: its lines "
                "are turns, which a random order would send before the turns they follow",
            )
        if (self.kind == "synthetic") != (self.path is None):
            raise InvalidRequestError(
                "dataset", f"--dataset {self.kind} needs --dataset-path"
                if self.path is None else "--dataset-path is only for jsonl and sharegpt"
            )  # fmt: skip

    def describe(self) -> str:
        if self.kind == "synthetic":
            return (f"synthetic, input {self.input_len.describe()}, "
                    f"output {self.output_len.describe()} tokens")  # fmt: skip
        return f"{self.kind} {self.path}" + (", multi-turn" if self.multi_turn else "")


@dataclass(frozen=True)
class LoadConfig:
    target: str  # HOST:PORT of a router (api openai: the server's base URL)
    api: str = "grpc"  # grpc: Tandem's API; openai: any OpenAI-compatible HTTP server
    request_rate: float = math.inf  # requests/s; inf: all at once (pace set by concurrency)
    burstiness: float = 1.0  # gamma shape; 1 is Poisson
    max_concurrency: int | None = None
    num_requests: int | None = 100
    duration_s: float | None = None  # instead of num_requests
    num_warmup: int = 2
    seed: int = 0
    temperature: float = 0.0
    timeout_s: float = 300.0  # per-request deadline
    slo: SLO = field(default_factory=SLO)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    progress: bool = True
    # The client's TLS and API key: AsyncTandemClient keyword arguments
    # (tandem.client.flags.client_kwargs); never written to the results.
    connect: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.api not in ("grpc", "openai"):
            raise InvalidRequestError("api", f"--api must be grpc or openai, got {self.api!r}")
        # A port past 65535 was dialled mod 65536 by gRPC (another server, perhaps), and
        # was an OverflowError traceback over HTTP.
        if self.api == "grpc":
            check_address(self.target, "--target", port_required=False)
        else:  # a base URL: [http[s]://]host[:port][/path]
            url = urlsplit(self.target if "://" in self.target else f"//{self.target}")
            check_address(url.netloc.rpartition("@")[2], "--target", port_required=False)
        arrivals.validate(self.request_rate, self.burstiness)
        if (self.num_requests is None) == (self.duration_s is None):
            raise InvalidRequestError("num_requests", "give one of --num-requests or --duration")
        for name, value in (("--num-requests", self.num_requests),
                            ("--max-concurrency", self.max_concurrency)):  # fmt: skip
            if value is not None and value < 1:
                raise InvalidRequestError(name, f"{name} must be >= 1, got {value}")
        if self.duration_s is not None and not 0 < self.duration_s < math.inf:
            raise InvalidRequestError("duration", f"--duration must be > 0 and finite, got "
                                      f"{self.duration_s}")  # fmt: skip
        # What every server refuses; finer limits (Tandem's 1e-5 minimum) are the
        # server's to name, and the report gives its first message for each status.
        if not 0 <= self.temperature < math.inf:
            raise InvalidRequestError(
                "temperature", f"--temperature must be finite and >= 0, got {self.temperature}"
            )
        if self.num_warmup < 0:
            raise InvalidRequestError("num_warmup", f"--num-warmup must be >= 0, got "
                                      f"{self.num_warmup}")  # fmt: skip
        if not 0 < self.timeout_s < math.inf:
            raise InvalidRequestError("timeout", f"--timeout must be > 0 and finite, got "
                                      f"{self.timeout_s}")  # fmt: skip
        for name, value in (("--slo-ttft-ms", self.slo.ttft_ms),
                            ("--slo-tpot-ms", self.slo.tpot_ms)):  # fmt: skip
            if value is not None and not value > 0:
                raise InvalidRequestError(name, f"{name} must be > 0, got {value}")
        if (
            self.duration_s is not None
            and math.isinf(self.request_rate)
            and (self.max_concurrency is None)
        ):
            raise InvalidRequestError(
                "duration", "--duration needs a finite --request-rate or a --max-concurrency"
            )

    def describe(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}/s"
        bound = (f"{self.num_requests} requests" if self.num_requests is not None
                 else f"{self.duration_s:g} s")  # fmt: skip
        conc = f", max concurrency {self.max_concurrency}" if self.max_concurrency else ""
        burst = f", burstiness {self.burstiness:g}" if self.burstiness != 1 else ""
        return f"{bound} at rate {rate}{burst}{conc}"


@dataclass
class LoadResult:
    config: LoadConfig
    model: ModelInfo
    records: list[RequestRecord]
    duration_s: float
    started_at: str  # wall-clock ISO time of the first measured send
    summary: Summary
    # Every spec as it was last sent (a follow-up turn with the replies it carried;
    # one never sent as in the dataset), warm-up first, in the dataset's order.
    sent: list[RequestSpec] = field(default_factory=list)


def run(config: LoadConfig, before_measured: Callable[[], object] | None = None) -> LoadResult:
    """``before_measured``: called (in a thread) after the warm-up, before the first
    measured request (``--metrics`` scrapes the servers there)."""
    return asyncio.run(run_async(config, before_measured))


async def run_async(
    config: LoadConfig, before_measured: Callable[[], object] | None = None
) -> LoadResult:
    if config.api == "openai":
        from tandem.bench.load.openai_api import OpenAIClient as client_cls
    else:
        client_cls = AsyncTandemClient
    async with client_cls(config.target, timeout=config.timeout_s, **config.connect) as client:
        try:
            model = await client.model_info(timeout=min(config.timeout_s, 30.0))
        except TandemClientError as exc:
            raise TandemClientError(exc.code, f"cannot reach a router at {config.target}: "
                                    f"{exc.details}") from None  # fmt: skip
        specs, more = await build_dataset(client, config, model)
        turns = _Turns(specs, config.dataset.multi_turn)
        warmup = [turns.start(k) for k in range(min(config.num_warmup, len(specs)))]
        if warmup:
            start = time.perf_counter()
            await asyncio.gather(*(_send(client, turns, turn, RequestRecord(
                -1, 0.0, specs[turn.k].input_len, specs[turn.k].output_len), config, start)
                for turn in warmup))  # fmt: skip
        if before_measured is not None:
            await asyncio.to_thread(before_measured)
        result = await _measure(client, config, model, turns, len(warmup), more)
        result.sent = turns.sent
        return result


@dataclass(eq=False)
class _Turn:
    """One send of spec ``k``: the send of the turn it follows, bound when it is
    scheduled, and the reply that later turns wait for (when some do)."""

    k: int
    after: _Turn | None = None
    reply: asyncio.Future[str | None] | None = None
    spec: RequestSpec | None = None  # as sent, once ``_Turns.ready`` has it


class _Turns:
    """The specs being sent, and for multi-turn chats the replies that follow-ups wait
    for and carry (see the module's docstring)."""

    def __init__(self, specs: list[RequestSpec], multi_turn: bool) -> None:
        self.specs = specs
        self.sent = list(specs)
        self.links = datasets.follow_ups(specs) if multi_turn else [None] * len(specs)
        self._followed = {link[0] for link in self.links if link is not None}
        self._latest: dict[int, _Turn] = {}  # the last send of each spec that is followed
        self.multi_turn = any(link is not None for link in self.links)

    def extend(self, specs: list[RequestSpec]) -> None:
        """More specs to send (synthetic ones: no turn follows another)."""
        self.specs += specs
        self.sent += specs
        self.links += [None] * len(specs)

    def waits(self, k: int) -> bool:
        """Whether spec ``k`` is a follow-up: it waits for a reply, then for its slot."""
        return self.links[k] is not None

    def start(self, k: int) -> _Turn:
        """Spec ``k`` is scheduled (call in send order): a send bound to the latest send
        of the turn it follows (a cycled file sends each again)."""
        link = self.links[k]
        turn = _Turn(k, None if link is None else self._latest.get(link[0]))
        if k in self._followed:
            turn.reply = asyncio.get_running_loop().create_future()
            self._latest[k] = turn
        return turn

    async def ready(self, turn: _Turn) -> RequestSpec:
        """``turn``'s spec as it goes out: a follow-up once its earlier turn has its reply."""
        spec = self.specs[turn.k]
        if turn.after is not None:
            assert turn.after.reply is not None
            reply = await asyncio.shield(turn.after.reply)
            p = self.links[turn.k][1]
            if reply is None:  # that turn failed: the file's text stands in for its reply
                reply = spec.messages[p][1]
            # As sent (set before its reply), or as in the file if it never got that far.
            history = (turn.after.spec or self.specs[turn.after.k]).messages
            messages = (*history, ("assistant", reply), *spec.messages[p + 1 :])
            spec = dataclasses.replace(spec, messages=messages, input_len=None)
        turn.spec = self.sent[turn.k] = spec
        return spec

    @staticmethod
    def done(turn: _Turn, reply: str | None) -> None:
        if turn.reply is not None and not turn.reply.done():
            turn.reply.set_result(reply)


T = TypeVar("T")

# Counting a dataset sends up to 16 Tokenize calls at once (datasets._gather_limited),
# which a router with a small max_queue, or a key's rate, refuses: those are sent again.
TOKENIZE_RETRY_S = 60.0
RETRY_WAIT_S = (0.05, 1.0)  # the first wait, doubled up to the second


async def _overloaded_again(
    call: Callable[[], Awaitable[T]], refused: Callable[[TandemClientError], None]
) -> T:
    """``call()``, again with backoff while the router answers RESOURCE_EXHAUSTED
    (``Overloaded``; not ``RequestTooLarge``, which never fits), for up to
    TOKENIZE_RETRY_S; ``refused`` is told of each refusal."""
    (wait, most), deadline = RETRY_WAIT_S, time.monotonic() + TOKENIZE_RETRY_S
    while True:
        try:
            return await call()
        except TandemClientError as exc:
            overloaded = exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED and not isinstance(
                exc, InvalidRequest
            )
            if not overloaded or time.monotonic() + wait > deadline:
                raise
            refused(exc)
        await asyncio.sleep(wait)
        wait = min(2 * wait, most)


async def build_dataset(
    client: AsyncTandemClient, config: LoadConfig, model: ModelInfo
) -> tuple[list[RequestSpec], Callable[[int], list[RequestSpec]] | None]:
    """Warm-up specs first, then the measured ones; and for a synthetic dataset, where
    more come from once those are sent (None: a file's are sent again)."""
    ds = config.dataset
    more = None
    if config.num_requests is not None:
        n = config.num_warmup + config.num_requests
    elif math.isfinite(config.request_rate):
        n = config.num_warmup + math.ceil(config.request_rate * config.duration_s * 1.5) + 8
    else:
        n = config.num_warmup + DURATION_POOL

    told = []

    def refused(exc: TandemClientError) -> None:
        if not told:  # a key's rate can make this minutes, which must not look hung
            told.append(exc)
            log.warning("the router refuses Tokenize calls for now (%s): the dataset's "
                        "prompts are counted as it lets them through", exc.details)  # fmt: skip

    async def count(**kw) -> int:
        return len(await _overloaded_again(lambda: client.tokenize(**kw), refused))

    if ds.kind == "synthetic":
        longest = ds.input_len.upper + ds.output_len.upper
        if longest > model.context_length:
            raise InvalidRequestError(
                "input_len",
                f"--input-len + --output-len may reach {longest} tokens, over the "
                f"context length {model.context_length} of {model.model_id}",
            )
        source = await datasets.SyntheticSource.calibrate(
            ds.input_len, ds.output_len, config.seed, count
        )
        specs = await datasets.count_inputs(source.more(n), count)
        more = source.more
    elif ds.kind == "jsonl":
        default = ds.file_output_len or int(ds.output_len.a)
        loaded = datasets.pick(datasets.load_jsonl(ds.path, default), n, config.seed, ds.in_order)
        specs = await datasets.count_inputs(loaded, count)
    elif ds.multi_turn:
        chats = datasets.load_sharegpt_chats(ds.path)
        chats = datasets.pick(chats, len(chats), config.seed, ds.in_order)  # whole chats
        specs = await datasets.sharegpt_chats(chats, n, model.context_length, count,
                                              ds.file_output_len)  # fmt: skip
        specs = datasets.pick(specs, n, config.seed, in_order=True)  # turns stay in order
    else:
        pairs = datasets.load_sharegpt(ds.path)
        specs = await datasets.sharegpt(pairs, model.context_length, count)
        if ds.file_output_len:
            specs = [RequestSpec(s.prompt, s.messages, s.input_len, ds.file_output_len)
                     for s in specs]  # fmt: skip
        specs = datasets.pick(specs, n, config.seed, ds.in_order)
    for i, s in enumerate(specs):
        if s.input_len is not None and s.input_len + s.output_len > model.context_length:
            raise InvalidRequestError(
                "dataset",
                f"request {i}: {s.input_len} prompt + {s.output_len} output tokens exceed "
                f"the context length {model.context_length}",
            )
    return specs, more


async def _measure(
    client: AsyncTandemClient,
    config: LoadConfig,
    model: ModelInfo,
    turns: _Turns,
    first: int,
    more: Callable[[int], list[RequestSpec]] | None,
) -> LoadResult:
    """Sends ``turns.specs[first:]``, the measured requests: as many as the run takes,
    a file's again from the first (cycling), synthetic ones drawn anew (``more``)."""
    bounded = config.num_requests is not None
    offsets = _from_first(arrivals.schedule(config.request_rate, config.burstiness, config.seed))
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    bar = _progress(config)
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    start = time.perf_counter()
    positions = _positions(turns, first, more)
    # Multi-turn: the last send of each spec. A cycled file sends a spec again only
    # once its last send is done, so at most one send of each waits for a reply
    # (else a follow-up-only cycle at an unlimited rate is scheduled without end).
    last: dict[int, asyncio.Task] = {}
    for i, (k, offset) in enumerate(zip(positions, offsets, strict=False)):
        if bounded and i >= config.num_requests:
            break
        if not bounded and offset >= config.duration_s:
            break
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if k in last and not last[k].done():
            await asyncio.wait([last[k]])
        slot = slots is not None and not turns.waits(k)  # a follow-up takes its own
        if slot:
            await slots.acquire()
        now = time.perf_counter() - start
        if not bounded and now >= config.duration_s:
            if slot:
                slots.release()
            break
        spec = turns.specs[k]
        rec = RequestRecord(i, now, spec.input_len, spec.output_len)
        records.append(rec)
        turn = turns.start(k)
        tasks.append(asyncio.create_task(_send(client, turns, turn, rec, config, start, slots,
                                               bar)))  # fmt: skip
        if turns.multi_turn:
            last[k] = tasks[-1]
    if bar is not None and not bounded:
        bar.total = len(records)
        bar.refresh()
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return LoadResult(config, model, records, duration, started_at,
                      summarize(records, duration, config.slo))  # fmt: skip


def _positions(
    turns: _Turns, first: int, more: Callable[[int], list[RequestSpec]] | None
) -> Iterator[int]:
    """Which spec to send next, from ``first`` on, for ever."""
    k = first
    while True:
        if k == len(turns.specs):
            if more is None:
                k = first
            else:
                turns.extend(more(DURATION_POOL))
        yield k
        k += 1


def _from_first(offsets: Iterator[float]) -> Iterator[float]:
    """The schedule shifted so that the first request goes at once: a run's duration
    (and so its throughput) is counted from the first send, not from an idle gap."""
    first = next(offsets)
    for offset in itertools.chain([first], offsets):
        yield offset - first


async def _send(
    client: AsyncTandemClient,
    turns: _Turns,
    turn: _Turn,
    rec: RequestRecord,
    config: LoadConfig,
    start: float,
    slots: asyncio.Semaphore | None = None,
    bar=None,
) -> None:
    """Sends ``turn``. The caller took its concurrency slot, but for a follow-up, which
    first waits for the reply it carries and then for a slot; neither wait is part of
    its latency (``start``: the run's clock, for its send time)."""
    texts: list[str] = []
    follow_up = turns.waits(turn.k)
    held = slots is not None and not follow_up
    t0 = time.perf_counter()
    try:
        spec = await turns.ready(turn)
        if follow_up:
            if slots is not None:
                await slots.acquire()
                held = True
            rec.send_time = time.perf_counter() - start
            rec.input_len = spec.input_len
            t0 = time.perf_counter()
        stream = client.generate(**spec.input_kwargs(), max_tokens=spec.output_len,
                                 ignore_eos=True, temperature=config.temperature)  # fmt: skip
        async for chunk in stream:
            rec.chunk_times.append(time.perf_counter() - t0)
            texts.append(chunk.text)
            rec.chunk_tokens.append(len(chunk.token_ids))
            if chunk.usage is not None:
                rec.prompt_tokens = chunk.usage.prompt_tokens
                rec.output_tokens = chunk.usage.completion_tokens
                rec.finish_reason = chunk.finish_reason
        if rec.finish_reason is None:
            rec.error = "INCOMPLETE"  # the stream ended without its last response
        elif rec.finish_reason in ("error", "cancelled"):
            rec.error = f"FINISH_{rec.finish_reason.upper()}"
    except TandemClientError as exc:
        rec.error, rec.error_detail = exc.code.name, exc.details
    except Exception as exc:  # noqa: BLE001 - a load test counts failures, it does not stop
        rec.error, rec.error_detail = type(exc).__name__, str(exc)
    finally:
        rec.end_time = time.perf_counter() - t0
        # A reply with no text (all special tokens, say) is not one a user would send
        # on: the follow-up carries the file's text, as after a failure.
        turns.done(turn, ("".join(texts) or None) if rec.ok else None)
        if held:
            slots.release()
        if bar is not None:
            bar.update(1)


def _progress(config: LoadConfig):
    if not config.progress or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    total = config.num_requests  # unknown up front for a duration-bounded run
    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, leave=False)
