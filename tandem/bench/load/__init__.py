"""The load-test harness behind ``tandem bench load`` / ``bench sweep`` and the planner.

It drives a deployment only through the public gRPC API (``tandem.client``) and
imports no router, worker or engine code, so it runs from any machine that can
reach a router. Times are taken on the client with ``time.perf_counter``.

- ``arrivals``  when requests are sent: Poisson / gamma at a rate, or a fixed concurrency
- ``datasets``  what is sent: synthetic lengths, a JSONL file, ShareGPT-like conversations
- ``runner``    sends them (asyncio) and records each request's token timeline
- ``metrics``   TTFT, TPOT, ITL, end-to-end latency, throughput, goodput under SLOs
- ``report``    the terminal table, JSON summary, per-request CSV and PNG plots
- ``sweep``     one load per rate or concurrency; the capacity under the SLOs
- ``plan``      KV bytes per token, what fits per decode worker, workers for a target rate
- ``cli``       the argument parsers and command functions the ``tandem`` command mounts
"""
