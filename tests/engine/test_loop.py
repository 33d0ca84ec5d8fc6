"""EngineLoop: the engine on its own thread, driven from asyncio."""

from __future__ import annotations

import asyncio
import threading
import time

from tandem.engine.loop import EngineLoop
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import FinishReason

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


async def _run(loop: EngineLoop, rid: str, prompt: list[int]) -> list:
    q = loop.subscribe(rid)
    await loop.call(lambda e: e.add_request(prompt, PARAMS, rid))
    outs = []
    while not outs or not outs[-1].finished:
        outs.append(await asyncio.wait_for(q.get(), 30))
    return outs


def test_concurrent_requests_stream_what_the_engine_gives(tiny_engine):
    prompts = [tiny_engine.tokenizer.encode(t) for t in ("a b c", "你好", "x" * 50, "hi")]
    expected = tiny_engine.generate(prompts, PARAMS)
    loop = EngineLoop(tiny_engine)
    loop.start()
    try:

        async def main():
            return await asyncio.gather(*(_run(loop, f"r{i}", p) for i, p in enumerate(prompts)))

        results = asyncio.run(main())
    finally:
        loop.stop()
    assert [[t for o in outs for t in o.token_ids] for outs in results] == expected
    assert all(outs[-1].finish_reason is FinishReason.LENGTH for outs in results)


def test_hooks_run_and_errors_reach_the_caller(tiny_engine):
    seen = []
    loop = EngineLoop(tiny_engine)
    loop.add_hook(lambda engine: seen.append(engine.has_unfinished()))
    loop.start()
    try:

        async def main():
            try:
                await loop.call(lambda e: e.add_request([], PARAMS))
            except ValueError as exc:
                return str(exc)

        assert asyncio.run(main()) == "prompt must not be empty"
        assert loop.submit(lambda e: e.kv.pool.num_used).result(5) == 0
    finally:
        loop.stop()
    assert seen, "hooks run even while the engine is idle"


def test_a_failing_step_fails_its_requests_and_frees_blocks(tiny_engine, monkeypatch):
    loop = EngineLoop(tiny_engine)
    loop.start()
    try:

        def boom():
            raise RuntimeError("model exploded")

        async def main():
            q = loop.subscribe("r")
            await loop.call(lambda e: monkeypatch.setattr(e, "step", boom))
            await loop.call(lambda e: e.add_request([5, 6, 7], PARAMS, "r"))
            return await asyncio.wait_for(q.get(), 10)

        out = asyncio.run(main())
    finally:
        loop.stop()
        monkeypatch.undo()
    assert out.finished and out.finish_reason is FinishReason.ERROR
    assert tiny_engine.kv.pool.num_used == 0


def test_a_failing_step_fails_its_own_requests_not_those_waiting_their_turn(monkeypatch):
    # Every request but the reservations was failed, queued ones that never ran too: on
    # a prefill worker one bad prompt failed the whole queue (and the router moved each
    # of them on, to fail again wherever the bad one went).
    from tests.conftest import make_engine

    engine = make_engine(max_num_seqs=1)  # one request a step: "queued" waits its turn
    expected = engine.generate([[8, 9, 10]], PARAMS)[0]
    run = engine.runner.run

    def poisoned(work, *args, **kwargs):
        if any(seq.request_id == "poison" for seq, _ in work):
            raise RuntimeError("a bug that one request's input reached")
        return run(work, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "run", poisoned)
    loop = EngineLoop(engine)
    loop.start()

    async def main():
        queues = {rid: loop.subscribe(rid) for rid in ("poison", "queued")}

        def add(e):
            e.add_request([5, 6, 7], PARAMS, "poison")
            e.add_request([8, 9, 10], PARAMS, "queued")

        await loop.call(add)
        outs = {}
        for rid, q in queues.items():
            outs[rid] = [await asyncio.wait_for(q.get(), 30)]
            while not outs[rid][-1].finished:
                outs[rid].append(await asyncio.wait_for(q.get(), 30))
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        loop.stop()
    assert outs["poison"][-1].finish_reason is FinishReason.ERROR
    assert outs["queued"][-1].finish_reason is FinishReason.LENGTH
    assert [t for o in outs["queued"] for t in o.token_ids] == expected
    assert engine.kv.pool.num_used == 0


def test_a_failing_step_leaves_the_kv_of_transfers_in_flight_to_their_owners(
    tiny_engine, monkeypatch
):
    loop = EngineLoop(tiny_engine)
    loop.start()
    try:

        def boom():
            raise RuntimeError("model exploded")

        def transfers(e):  # KV being read (held after a prefill) and being written (reserved)
            e.add_request([5, 6, 7] * 10, PARAMS, "held", prefill_only=True)
            while not e.step():
                pass
            e.reserve([8, 9] * 20, PARAMS, "reserved")
            return e.kv.pool.num_used

        async def main():
            transfer_blocks = await loop.call(transfers)
            q = loop.subscribe("r")
            await loop.call(lambda e: monkeypatch.setattr(e, "step", boom))
            await loop.call(lambda e: e.add_request([5, 6, 7], PARAMS, "r"))
            return transfer_blocks, await asyncio.wait_for(q.get(), 10)

        transfer_blocks, out = asyncio.run(main())
        assert out.finished and out.finish_reason is FinishReason.ERROR
        # The failed request's blocks are back; the transfers' are still theirs.
        assert loop.submit(lambda e: e.kv.pool.num_used).result(5) == transfer_blocks > 0
        assert loop.submit(lambda e: (e.release("held"), e.abort("reserved"))).result(5) == (
            True, True)  # fmt: skip
        assert loop.submit(lambda e: e.kv.pool.num_used).result(5) == 0
    finally:
        loop.stop()
        monkeypatch.undo()


def test_requests_a_step_finished_or_held_before_it_failed_are_told(tiny_engine, monkeypatch):
    # The step held X's prompt for its transfer and finished Z (one token), then failed
    # on Y: their outputs went with the step, so their owners must hear of it (X's
    # frees the held KV).
    real = tiny_engine._postprocess

    def post(req, token, logprob=None):
        if req.seq.request_id == "Y":
            raise RuntimeError("detokenizer exploded")
        return real(req, token, logprob)

    loop = EngineLoop(tiny_engine)
    loop.start()
    try:

        async def main():
            told = loop.subscribe("X"), loop.subscribe("Z"), loop.subscribe("Y")

            def add(e):
                monkeypatch.setattr(e, "_postprocess", post)
                e.add_request([5, 6, 7] * 10, PARAMS, "X", prefill_only=True)
                one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
                e.add_request([4, 3] * 10, one, "Z")
                e.add_request([8, 9] * 10, PARAMS, "Y")

            await loop.call(add)
            return [await asyncio.wait_for(q.get(), 10) for q in told]

        for out in asyncio.run(main()):
            assert out.finished and out.finish_reason is FinishReason.ERROR
        assert loop.submit(lambda e: e.held_ids).result(5) == {"X"}  # its owner frees it
        assert loop.submit(lambda e: e.release("X")).result(5)
        assert loop.submit(lambda e: e.kv.pool.num_used).result(5) == 0
    finally:
        loop.stop()
        monkeypatch.undo()


def test_wake_runs_the_hooks_of_an_idle_loop_without_waiting_for_its_poll(tiny_engine):
    ran = threading.Event()
    loop = EngineLoop(tiny_engine, poll_interval_s=3600)
    loop.add_hook(lambda engine: ran.set())
    loop.start()
    try:
        time.sleep(0.1)
        assert not ran.is_set()  # the idle thread waits out its poll before any hook
        for _ in range(2):
            loop.wake()
            assert ran.wait(10), "wake ran the hooks; the poll would have taken an hour"
            ran.clear()
        assert loop.submit(lambda e: 7).result(10) == 7  # commands still run after a wake
    finally:
        loop.stop()


def test_the_hooks_see_the_last_steps_outcome_before_the_thread_sleeps(tiny_engine):
    idle = threading.Event()
    loop = EngineLoop(tiny_engine, poll_interval_s=3600)
    loop.add_hook(lambda engine: idle.set() if not engine.has_unfinished() else idle.clear())
    loop.start()
    try:
        outs = asyncio.run(_run(loop, "r", [5, 6, 7]))
        assert outs[-1].finished
        # What a worker publishes from its hooks (its load) is the finished state, now.
        assert idle.wait(10), "the hooks ran after the last step, not an hour later"
    finally:
        loop.stop()


def test_a_command_returns_once_the_hooks_have_seen_it(tiny_engine):
    published = []

    def publish(engine):  # what a worker's Status reads: slow, so any race would show
        time.sleep(0.05)
        published.append(len(engine.scheduler.waiting))

    loop = EngineLoop(tiny_engine)
    loop.add_hook(publish)
    loop.start()
    try:
        loop.submit(lambda e: e.add_request([5, 6, 7], PARAMS, "r")).result(10)
        assert published[-1] == 1, "the caller heard back before its request was published"
        loop.submit(lambda e: e.abort("r")).result(10)
    finally:
        loop.stop()


def test_the_watchdog_reports_a_step_that_never_returns_but_no_idle_or_busy_loop(
    tiny_engine, monkeypatch
):
    stalls: list[tuple[float, str]] = []
    reported = threading.Event()
    gate = threading.Event()
    slow = {"s": 0.0}
    step = tiny_engine.step

    def stepping():
        if slow["s"] is None:
            assert gate.wait(30)  # the hang: a kernel or collective that never returns
        else:
            time.sleep(slow["s"])
        return step()

    monkeypatch.setattr(tiny_engine, "step", stepping)
    loop = EngineLoop(
        tiny_engine,
        poll_interval_s=0.05,
        stall_timeout_s=0.5,
        on_stall=lambda s, stack: (stalls.append((s, stack)), reported.set()),
    )
    loop.start()
    try:
        time.sleep(1.5)  # idle three times the timeout: waiting for work is not a stall
        slow["s"] = 0.3  # busy for 2.4 s in all, in steps shorter than the timeout
        assert len(asyncio.run(_run(loop, "busy", [5, 6, 7]))) == 12
        assert not stalls, "a busy loop was taken for a hung one"
        slow["s"] = None
        started = time.monotonic()
        loop.submit(lambda e: e.add_request([5, 6, 7], PARAMS, "hung")).result(10)
        assert reported.wait(10), "the hung step was not reported"
        assert 0.5 < time.monotonic() - started < 5
        ((seconds, stack),) = stalls
        assert seconds > 0.5
        assert "in stepping" in stack and "gate.wait" in stack  # where the thread is stuck
        gate.set()
        loop.submit(lambda e: e.abort("hung")).result(10)
    finally:
        gate.set()
        loop.stop()
        monkeypatch.undo()
    assert len(stalls) == 1, "reported once"


def test_a_device_error_goes_to_its_handler_before_the_steps_requests_fail(
    tiny_engine, monkeypatch
):
    import torch

    seen: list[tuple[str, BaseException]] = []
    errors = iter(
        [RuntimeError("a bug one request reached"), torch.AcceleratorError("CUDA error: ...")]
    )

    def boom():
        raise next(errors)

    loop = EngineLoop(tiny_engine, on_device_fault=lambda exc: seen.append(("fault", exc)))
    loop.start()
    try:

        async def run(rid):
            q = loop.subscribe(rid)
            await loop.call(lambda e: e.add_request([5, 6, 7], PARAMS, rid))
            out = await asyncio.wait_for(q.get(), 30)
            seen.append((rid, out.finish_reason))

        monkeypatch.setattr(tiny_engine, "step", boom)
        asyncio.run(run("bug"))  # not the device's: the loop goes on without the handler
        asyncio.run(run("device"))
        assert loop.submit(lambda e: e.kv.pool.num_used).result(5) == 0
    finally:
        loop.stop()
        monkeypatch.undo()
    (_, fault) = seen[1]
    assert seen == [("bug", FinishReason.ERROR), ("fault", fault), ("device", FinishReason.ERROR)]
    assert isinstance(fault, torch.AcceleratorError)


def test_work_that_cannot_be_scheduled_is_no_step_and_no_spin():
    # Every block held (a prompt's KV awaiting its transfer) and a prompt waiting for
    # blocks: the loop "stepped" an empty batch tens of thousands of times a second,
    # and the step hooks (histograms, the step cost the router reads) counted each
    # with the last real step's figures.
    from tests.conftest import make_engine

    engine = make_engine(num_blocks=8)
    params = SamplingParams(max_tokens=4, temperature=0)
    engine.add_request(list(range(1, 100)), params, "held", prefill_only=True)  # 7 blocks
    engine.step()
    assert engine.held_ids == {"held"}
    engine.add_request(list(range(200, 259)), params, "waits")  # 4 blocks; 1 is free
    loop = EngineLoop(engine)
    steps, looks = [], []
    loop.add_step_hook(lambda e, outputs: steps.append(e.stats.last_sequences))
    loop.add_hook(lambda e: looks.append(time.monotonic()))
    loop.start()
    try:
        time.sleep(0.5)
        assert steps == [] and len(looks) < 20  # it waits out its poll interval (0.1 s)
        loop.submit(lambda e: e.release("held")).result(10)
        deadline = time.monotonic() + 10
        while not steps and time.monotonic() < deadline:
            time.sleep(0.01)
        assert steps and steps[0] == 1  # the waiting prompt, once the blocks came back
    finally:
        loop.stop()
