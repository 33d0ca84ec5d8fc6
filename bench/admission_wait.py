"""How long a decode worker takes to admit a request once its KV has arrived: its
engine thread woken by the KV receiver (as the decode worker runs now) against the
same thread looking at its reservations every 2 ms (as it did before), side by side
in one run.

    python bench/admission_wait.py [--model tiny-random] [--requests 60] [--json]

One process, wired as ``DecodeServer`` wires it: an engine on its ``EngineLoop``
with ``KvAdmission`` as a hook, and an in-process KV receiver; the prefill side is
an in-process sender reading a second engine's cache. Per request: reserve through
the loop (as the ``Decode`` call does), pause a random 0-5 ms (so that arrivals fall
anywhere between two polls), send the KV and the first token, and time from the
sender's ack (the transfer is DONE on the decode side) to the admitted first token
on the caller's event loop. The two ways alternate request by request; the table
gives the median, 90th percentile and maximum of each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from tandem.config import EngineConfig  # noqa: E402
from tandem.decode_worker.admission import KvAdmission  # noqa: E402
from tandem.engine.engine import LLMEngine  # noqa: E402
from tandem.engine.loop import EngineLoop  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.kv_transfer import make_receiver, make_sender  # noqa: E402
from tandem.worker.request import WorkRequest  # noqa: E402

WAYS = {"woken": 0.1, "poll 2 ms": 0.002}  # way -> the loop's idle poll, seconds


async def _one(loop, admission, receiver, sender, src, way: str, i: int, rng) -> float:
    """Seconds from the KV's arrival to the admitted first token, one request."""
    receiver.notify(loop.wake if way == "woken" else lambda: None)
    loop.poll_interval_s = WAYS[way]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    req = WorkRequest(f"r{i}", [7] * 40, params, [])
    admitted = asyncio.get_running_loop().create_future()
    dest = await loop.call(lambda e: admission.reserve(e, req, admitted))
    await asyncio.sleep(rng.uniform(0, 0.005))
    blocks = src.kv.pool.allocate(src.kv.blocks_for(len(req.prompt_ids)))
    try:
        sender.send(dest, blocks, first_token=11).result(10)
        arrived = time.perf_counter()
        await asyncio.wait_for(admitted, 10)
        waited = time.perf_counter() - arrived
    finally:
        src.kv.pool.free(blocks)
        await loop.call(lambda e: admission.end(e, req.request_id))
    return waited


async def _run(args: argparse.Namespace) -> dict[str, list[float]]:
    engine = LLMEngine(EngineConfig(model=args.model, enable_prefix_caching=False))
    src = LLMEngine(EngineConfig(model=args.model, enable_prefix_caching=False))
    fp = engine.kv_fingerprint()
    receiver = make_receiver("inproc", engine.kv.tensor, fp)
    sender = make_sender("inproc", src.kv.tensor, fp)
    admission = KvAdmission(receiver, lease_s=30)
    loop = EngineLoop(engine)
    loop.add_hook(admission.poll)
    loop.start()
    rng = random.Random(0)
    waits: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for i in range(2 * args.requests):
            way = list(WAYS)[i % 2]
            waits[way].append(await _one(loop, admission, receiver, sender, src, way, i, rng))
    finally:
        loop.stop()
        sender.close()
        receiver.close()
    leaked = engine.kv.pool.num_used + src.kv.pool.num_used
    if leaked:
        raise RuntimeError(f"{leaked} KV blocks were left allocated")
    return waits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--requests", type=int, default=60, help="per way")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    waits = asyncio.run(_run(args))
    result = {
        way: {
            "median_ms": round(statistics.median(w) * 1e3, 3),
            "p90_ms": round(sorted(w)[int(0.9 * (len(w) - 1))] * 1e3, 3),
            "max_ms": round(max(w) * 1e3, 3),
        }
        for way, w in waits.items()
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"KV arrived -> first token admitted, {args.requests} requests each, ms")
    print(f"{'':<10} {'median':>8} {'p90':>8} {'max':>8}")
    for way, r in result.items():
        print(f"{way:<10} {r['median_ms']:>8.3f} {r['p90_ms']:>8.3f} {r['max_ms']:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
