"""``tandem bench load``, ``tandem bench sweep`` and ``tandem plan``: flags and commands.

``tandem/cli.py`` mounts these parsers; the commands import only the client side
(load and sweep) or only the model config reader (plan).
"""

from __future__ import annotations

import argparse
import logging
import math

from tandem.errors import TandemError

log = logging.getLogger("tandem")


def add_bench_parsers(bench_sub) -> None:
    load = bench_sub.add_parser(
        "load",
        help="load-test a running deployment through its gRPC API (or an OpenAI-compatible "
        "one: --api openai): TTFT, TPOT, goodput",
    )
    _add_load_flags(load)
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (default inf: all at once, paced by --max-concurrency)",
    )
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight (a fixed concurrency)",
    )
    load.add_argument(
        "--metrics", default=None, metavar="HOST:PORT",
        help="the router's metrics address: scrape it and its workers before and after the "
             "run, compare with the client's figures, save them under --out/server-metrics",
    )  # fmt: skip
    load.set_defaults(func=cmd_load)  # fmt: skip

    sweep = bench_sub.add_parser(
        "sweep", help="load at several rates or concurrencies; the capacity under the SLOs"
    )
    _add_load_flags(sweep)
    points = sweep.add_mutually_exclusive_group(required=True)
    points.add_argument("--request-rates", type=_floats, help="comma-separated, e.g. 1,2,4,8")
    points.add_argument("--concurrencies", type=_ints, help="comma-separated, e.g. 1,4,16")
    sweep.add_argument(
        "--target-attainment",
        type=float,
        default=0.9,
        help="SLO attainment the capacity must keep (default 0.9)",
    )
    sweep.add_argument(
        "--prefill-workers",
        type=int,
        default=1,
        help="prefill workers of the deployment under test, recorded for `tandem plan` "
        "(default 1; 0: a colocated deployment)",
    )
    sweep.add_argument(
        "--decode-workers",
        type=int,
        default=1,
        help="decode workers of the deployment under test (default 1)",
    )
    sweep.set_defaults(func=cmd_sweep)  # fmt: skip


def _add_load_flags(p: argparse.ArgumentParser) -> None:
    from tandem.client.flags import add_client_flags

    p.add_argument(
        "--target",
        required=True,
        metavar="HOST:PORT",
        help="a Tandem router's gRPC address; with --api openai, the server's "
        "base URL (http://HOST:PORT)",
    )
    p.add_argument("--api", choices=("grpc", "openai"), default="grpc",
                   help="grpc: Tandem's API (default); openai: any OpenAI-compatible HTTP "
                        "server (Tandem's --http-port, vLLM, SGLang, ...)")  # fmt: skip
    add_client_flags(p)
    g = p.add_argument_group("arrivals")
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 Poisson (default), < 1 burstier",
    )
    g.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="measured requests (default 100 unless --duration)",
    )
    g.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="S",
        help="send for S seconds instead of a fixed count",
    )
    g.add_argument(
        "--num-warmup",
        type=int,
        default=2,
        help="requests sent first and left out of the results (default 2)",
    )
    g.add_argument("--seed", type=int, default=0, help="the same seed repeats the run's inputs")
    g.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="per-request deadline (default 300)",
    )
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="synthetic", choices=("synthetic", "jsonl", "sharegpt"))
    d.add_argument("--dataset-path", default=None, help="the file, for jsonl and sharegpt")
    d.add_argument(
        "--dataset-in-order",
        action="store_true",
        help="send the file's requests in its order, not a seeded random one (multi-turn "
        "chats whose turns follow each other)",
    )
    d.add_argument(
        "--multi-turn",
        action="store_true",
        help="send chats turn by turn, each turn once the one before it is answered, with "
        "the server's reply in place of the file's: a jsonl line that repeats an earlier "
        "line's messages and an assistant turn is that chat's next turn (needs "
        "--dataset-in-order); sharegpt: every human turn of a conversation, not only the "
        "first",
    )
    d.add_argument(
        "--input-len",
        default="128",
        help="synthetic prompt tokens: N, uniform:LO-HI or normal:MEAN,STD (default 128)",
    )
    d.add_argument(
        "--output-len",
        default=None,
        help="output tokens, same forms (default 128); for jsonl the default of "
        "lines without output_len, for sharegpt it replaces the replies' lengths",
    )
    d.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    s = p.add_argument_group("SLOs (goodput counts the requests that meet all given)")
    s.add_argument("--slo-ttft-ms", type=float, default=None)
    s.add_argument("--slo-tpot-ms", type=float, default=None)
    o = p.add_argument_group("output")
    o.add_argument(
        "--out", default=None, metavar="DIR", help="write summary.json, requests.csv and plots here"
    )
    o.add_argument("--quiet", action="store_true", help="no progress bar")  # fmt: skip


def add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="KV memory per decode worker and workers needed, from a model config"
    )
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="a built-in name, a Hugging Face directory or config.json, or a .gguf",
    )
    p.add_argument(
        "--device-memory-gib", type=float, default=80.0, help="memory per device (default 80)"
    )
    p.add_argument(
        "--decode-tp",
        "--devices-per-worker",
        dest="devices_per_worker",
        type=int,
        default=1,
        help="decode workers' tensor_parallel_size: ranks (devices) per worker (default 1)",
    )
    p.add_argument(
        "--prefill-tp",
        type=int,
        default=1,
        help="prefill workers' tensor_parallel_size, for the device count (default 1)",
    )
    p.add_argument(
        "--memory-utilization",
        type=float,
        default=0.9,
        help="fraction of device memory for weights + KV (default 0.9)",
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        help="engine.kv_cache_dtype: auto (default: the weights' dtype) or int8 (with its "
        "scales); a float dtype (bfloat16, float16, float32) sets the weights' dtype too",
    )
    p.add_argument(
        "--weight-dtype",
        "--dtype",
        dest="weight_dtype",
        default=None,
        help="engine.dtype: bfloat16, float16 or float32 (default: a float --kv-dtype, "
        "else bfloat16)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument(
        "--context-len",
        type=int,
        default=4096,
        help="prompt + output tokens per sequence (default 4096)",
    )
    p.add_argument(
        "--sweep",
        default=None,
        metavar="SWEEP_JSON",
        help="a sweep.json from `tandem bench sweep`, to size the pools",
    )
    p.add_argument(
        "--target-rate", type=float, default=None, help="requests/s to serve (with --sweep)"
    )
    p.set_defaults(func=cmd_plan)  # fmt: skip


def load_config(args: argparse.Namespace, **overrides):
    from tandem.bench.load.datasets import LengthDist
    from tandem.bench.load.metrics import SLO
    from tandem.bench.load.runner import DatasetConfig, LoadConfig
    from tandem.client.flags import client_kwargs

    output = LengthDist.parse(args.output_len or "128", "--output-len")
    file_output = None
    if args.dataset != "synthetic" and args.output_len is not None:
        if output.kind != "fixed":
            from tandem.errors import InvalidRequestError

            raise InvalidRequestError("--output-len", "--output-len for a file dataset must "
                                      f"be a number, got {args.output_len!r}")  # fmt: skip
        file_output = int(output.a)
    dataset = DatasetConfig(
        kind=args.dataset,
        path=args.dataset_path,
        input_len=LengthDist.parse(args.input_len, "--input-len"),
        output_len=output,
        file_output_len=file_output,
        in_order=args.dataset_in_order,
        multi_turn=args.multi_turn,
    )
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = 100
    values = dict(
        target=args.target,
        api=args.api,
        request_rate=getattr(args, "request_rate", math.inf),
        burstiness=args.burstiness,
        max_concurrency=getattr(args, "max_concurrency", None),
        num_requests=num_requests,
        duration_s=args.duration,
        num_warmup=args.num_warmup,
        seed=args.seed,
        temperature=args.temperature,
        timeout_s=args.timeout,
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
        dataset=dataset,
        progress=not args.quiet,
        connect=client_kwargs(args),
    )
    values.update(overrides)
    return LoadConfig(**values)


def cmd_load(args: argparse.Namespace) -> int:
    from tandem.bench.load import report, server_metrics
    from tandem.bench.load.runner import run
    from tandem.metrics.scrape import ScrapeError

    config = load_config(args)
    _usable_out(args.out)
    log.info("load: %s; %s", config.describe(), config.dataset.describe())
    before: dict[str, str] = {}

    def scrape_before() -> None:  # after the warm-up: only the measured requests count
        try:
            before.update(server_metrics.snapshot(args.metrics))
        except ScrapeError as exc:  # the run goes on; the server's view is what is lost
            log.warning("load: no server metrics before the measured requests: %s", exc)

    if args.metrics:
        server_metrics.snapshot(args.metrics)  # a wrong address fails now, not after the run
    result = run(config, scrape_before if args.metrics else None)
    print(report.table(result), flush=True)
    paths = report.write(result, args.out) if args.out else []  # first: the run's own
    after = None
    if args.metrics and before:
        try:
            after = server_metrics.snapshot(args.metrics)
        except ScrapeError as exc:  # the run's results stand without the server's view
            log.warning("load: no server metrics after the run: %s", exc)
    if after is not None:
        print(server_metrics.compare(before, after, result.summary), flush=True)
        if args.out:
            paths += server_metrics.write(before, after, args.out)
    for path in paths:
        log.info("wrote %s", path)
    if result.summary.num_requests and not result.summary.completed:
        log.error("load: none of the %d measured requests completed (see errors above)",
                  result.summary.num_requests)  # fmt: skip
        return 1  # a script must not take this for a measurement
    return 0


def sweep_config(args: argparse.Namespace):
    from tandem.bench.load import sweep

    # The base stands for the first point (each point replaces rate or concurrency),
    # so that checks such as "--duration needs a finite rate" see a real point.
    if args.request_rates:
        first = {"request_rate": min(args.request_rates)}
    elif args.concurrencies:
        first = {"max_concurrency": min(args.concurrencies)}
    else:
        first = {}
    return sweep.SweepConfig(
        base=load_config(args, **first),
        rates=tuple(args.request_rates or ()),
        concurrencies=tuple(args.concurrencies or ()),
        target_attainment=args.target_attainment,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
    )


def cmd_sweep(args: argparse.Namespace) -> int:
    from tandem.bench.load import sweep

    if not args.out:
        from tandem.errors import InvalidRequestError

        raise InvalidRequestError("--out", "bench sweep needs --out DIR for its results")
    config = sweep_config(args)
    _usable_out(args.out)

    def progress(result) -> None:
        s = result.summary
        log.info("sweep point %s: %.2f req/s, TTFT p50 %.0f ms, TPOT p50 %.1f ms, "
                 "SLO attainment %.1f%%, %d failed", result.config.describe(),
                 s.request_throughput, s.ttft_ms.median, s.tpot_ms.median,
                 100 * s.slo_attainment, s.failed)  # fmt: skip

    data = sweep.run_sweep(config, args.out, on_point=progress)
    print(sweep.table(data), flush=True)
    log.info("wrote %s/sweep.json, %s, %s", args.out, sweep.LATENCY_PLOT, sweep.ATTAINMENT_PLOT)
    if not any(p["summary"]["completed"] for p in data["points"]):
        log.error("sweep: no point completed any of its requests (each point's errors are "
                  "in its summary.json)")  # fmt: skip
        return 1  # as bench load: a dead cluster is not a slow one
    return 0


def _usable_out(out: str | None) -> None:
    """``--out`` made (or found) a directory before any request is sent, not after."""
    if out:
        from pathlib import Path

        from tandem.errors import InvalidRequestError

        try:
            Path(out).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidRequestError("--out", f"--out {out}: {exc.strerror or exc}") from exc


def cmd_plan(args: argparse.Namespace) -> int:
    from tandem.bench.load import plan
    from tandem.errors import InvalidRequestError

    if (args.sweep is None) != (args.target_rate is None):
        raise InvalidRequestError("--sweep", "--sweep and --target-rate go together")
    hw = plan.Hardware(
        device_memory_gib=args.device_memory_gib,
        devices_per_worker=args.devices_per_worker,
        prefill_devices_per_worker=args.prefill_tp,
        memory_utilization=args.memory_utilization,
        kv_dtype=args.kv_dtype,
        weight_dtype=args.weight_dtype,
        block_size=args.block_size,
    )
    sweep = plan.read_sweep(args.sweep) if args.sweep else None
    measured = (sweep or {}).get("model")
    if measured and measured != args.model:  # a path and its served id can differ too
        log.warning("plan: the sweep measured model %r; the memory below is for --model %r",
                    measured, args.model)  # fmt: skip
    mc = plan.model_config(args.model)
    memory = plan.memory_plan(mc, hw, args.context_len, model=args.model)
    print("\n".join(memory.lines))
    if sweep is not None:
        workers = plan.worker_plan(sweep, args.target_rate, memory, hw.block_size, hw)
        print("\n".join(workers.lines))
    return 0


def demo_load(address: str, **connect) -> None:
    """The short load that ends ``tandem demo``: 16 requests, 4 at a time; ``connect``:
    the client's TLS and API key."""
    from tandem.bench.load import report
    from tandem.bench.load.datasets import LengthDist
    from tandem.bench.load.runner import DatasetConfig, LoadConfig, run

    config = LoadConfig(
        target=address,
        max_concurrency=4,
        num_requests=16,
        num_warmup=1,
        timeout_s=120,
        dataset=DatasetConfig(input_len=LengthDist("uniform", 32, 96),
                              output_len=LengthDist("fixed", 32)),
        connect=connect,
    )  # fmt: skip
    log.info("demo: load test, %s; %s", config.describe(), config.dataset.describe())
    result = run(config)
    print(report.table(result), flush=True)
    if result.summary.failed:  # an idle local cluster serves all 16
        raise TandemError(f"demo: {result.summary.failed} of the load test's requests failed")


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
