"""The ``tandem`` command.

Bad input and misconfiguration end with a one-line error on stderr and exit
code 2 (no traceback); stdout carries only generated text or requested data.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time

from tandem.argtypes import at_least, port
from tandem.client.flags import add_client_flags, client_kwargs
from tandem.errors import ConfigError, TandemError

EXIT_USAGE = 2


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="tokens to generate (default 256; through a router, unset: it stops "
                   "at the context's end where that comes first)")  # fmt: skip
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 is greedy (the default); from 1e-5 up samples",
    )
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus threshold in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="smollm2-135m-instruct (default), tiny-random, "
        "a Hugging Face directory or a .gguf file",
    )
    g.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16, float16")
    g.add_argument("--device", default=None, help="auto (default), cpu, cuda, cuda:N")
    g.add_argument(
        "--attention-backend",
        default=None,
        help="auto (default: triton on CUDA, cpu on CPU where it compiles), torch, cpu, triton",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="auto (default: the model's dtype) or int8 (0.52x the KV memory of bfloat16)",
    )
    g.add_argument(
        "--kv-window",
        type=at_least(1),
        default=None,
        help="keep only the last N tokens' KV (and the sinks'): constant memory, lower quality",
    )
    g.add_argument(
        "--kv-sinks", type=at_least(0), default=None, help="with --kv-window: first tokens kept (4)"
    )
    g.add_argument("--threads", type=at_least(1), default=None, help="torch intra-op threads")
    _add_tensor_parallel_flag(g)
    g.add_argument("--config", default=None, help="YAML file; its `engine:` section sets defaults")


def _add_tensor_parallel_flag(p) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        "--tp",
        dest="tensor_parallel_size",
        type=at_least(1),
        default=None,
        metavar="N",
        help="split the model over N processes and devices (default 1)",
    )


# The router's public-port flags (tandem serve, python -m tandem.router): dest is the
# RouterConfig field, so that mapping them is one loop.
ROUTER_SECURITY_FLAGS = (
    ("--tls-cert", "tls_cert_file", "the router's TLS certificate (PEM); with --tls-key"),
    ("--tls-key", "tls_key_file", "its private key (PEM)"),
    ("--tls-client-ca", "tls_client_ca_file", "mutual TLS: clients need a certificate it signed"),
    ("--api-keys-file", "api_keys_file", "API keys, one a line (also: $TANDEM_API_KEYS)"),
)


def add_router_security_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the router's public port (see README: Security)")
    for flag, dest, text in ROUTER_SECURITY_FLAGS:
        g.add_argument(flag, dest=dest, metavar="FILE", default=None, help=text)
    g.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow a non-loopback --host without TLS or without authentication",
    )


def router_security_settings(args: argparse.Namespace) -> dict:
    """The RouterConfig fields the public-port flags set (those given only)."""
    names = [dest for _, dest, _ in ROUTER_SECURITY_FLAGS] + ["insecure"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Disaggregated prefill/decode LLM serving."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="stream an answer to one prompt")
    gen.add_argument("prompt", help="the user message (or plain text with --raw)")
    gen.add_argument(
        "--colocated",
        action="store_true",
        help="run prefill and decode in this process",
    )
    gen.add_argument("--router", default=None, metavar="HOST:PORT", help="stream through a router")
    gen.add_argument("--raw", action="store_true", help="send PROMPT as plain text, no template")
    add_client_flags(gen)
    _add_engine_flags(gen)
    _add_sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser(
        "serve", help="start a router and prefill/decode workers on this machine"
    )
    serve.add_argument("--model", default=None, help="default: smollm2-135m-instruct")
    serve.add_argument("--prefill", type=at_least(0), default=None,
                       help="prefill workers (default 1)")  # fmt: skip
    serve.add_argument("--decode", type=at_least(1), default=None,
                       help="decode workers (default 1)")  # fmt: skip
    serve.add_argument(
        "--colocated",
        type=at_least(1),
        default=None,
        metavar="N",
        help="N workers that prefill and decode, no prefill pool (no KV transfer)",
    )
    serve.add_argument(
        "--disaggregation",
        choices=("always", "conditional", "never"),
        default=None,
        help="where prompts are prefilled (default always: on the prefill pool)",
    )
    serve.add_argument("--host", default=None, help="router address (default 127.0.0.1)")
    serve.add_argument("--port", type=port, default=None, help="router port (default 50051)")
    serve.add_argument(
        "--http-port",
        type=port,
        default=None,
        help="the router also serves the OpenAI-compatible HTTP API here (0: a free port)",
    )
    serve.add_argument("--threads", type=at_least(1), default=None,
                       help="torch threads per rank (default: engine.num_threads, "
                       "else the cores shared out)")  # fmt: skip
    _add_tensor_parallel_flag(serve)
    for pool in ("prefill", "decode"):
        serve.add_argument(
            f"--{pool}-tp",
            dest=f"{pool}_tensor_parallel_size",
            type=at_least(1),
            default=None,
            metavar="N",
            help=f"the {pool} pool's width, if not --tp's (the widths may differ)",
        )
    serve.add_argument(
        "--metrics",
        action="store_true",
        default=None,
        help="every process serves Prometheus metrics on a free port (printed once serving)",
    )
    serve.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=None,
        help="the processes' logs (in the run dir): text lines, or one JSON object per line",
    )
    serve.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="the run dir: each process's config and log, kept after the stop (default: a "
        "new temporary directory each run); a start keeps the last run's logs as NAME.log.1",
    )
    serve.add_argument(
        "--config",
        default=None,
        help="YAML: num_prefill, num_decode, engine:, router:, prefill:, decode: sections",
    )
    add_router_security_flags(serve)
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser(
        "demo", help="start a local cluster, stream an answer, run a short load test, stop it"
    )
    demo.add_argument(
        "--prompt", default="In three sentences, why does a language model server separate "
        "prefill from decode?",
    )  # fmt: skip
    for flag, kind, text in (("--model", str, "default: smollm2-135m-instruct"),
                             ("--prefill", at_least(0), "prefill workers (default 1)"),
                             ("--decode", at_least(1), "decode workers (default 1)"),
                             ("--threads", at_least(1), "torch threads per worker"),
                             ("--config", str, "YAML, as for serve")):  # fmt: skip
        demo.add_argument(flag, type=kind, default=None, help=text)
    demo.set_defaults(func=cmd_demo, host=None, port=None)
    add_client_flags(demo)  # for a --config whose router: section asks for TLS or keys
    _add_sampling_flags(demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    eng = bench_sub.add_parser(
        "engine", help="engine throughput vs Hugging Face generate, side by side"
    )
    from tandem.bench.engine_throughput import add_arguments

    add_arguments(eng)
    eng.set_defaults(func=cmd_bench_engine)
    xfer = bench_sub.add_parser(
        "transfer", help="KV transfer GB/s over UCX between two processes vs memcpy"
    )
    from tandem.bench.transfer import add_arguments as add_transfer_arguments

    add_transfer_arguments(xfer)
    xfer.set_defaults(func=cmd_bench_transfer)
    from tandem.bench.load.cli import add_bench_parsers, add_plan_parser

    add_bench_parsers(bench_sub)
    add_plan_parser(sub)

    top = sub.add_parser("top", help="a live view of a running cluster, from its metrics")
    where = top.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--target",
        metavar="HOST:PORT",
        help="the router's metrics address (its workers are found from it)",
    )
    where.add_argument(
        "--file",
        metavar="PATH",
        help="a Prometheus file_sd targets file (tandem serve --metrics writes "
        "<run dir>/prometheus-targets.json; tandem ray up keeps one)",
    )
    top.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    top.add_argument(
        "--once",
        action="store_true",
        help="print one frame (two scrapes an interval apart) and exit",
    )
    top.set_defaults(func=cmd_top)  # fmt: skip

    from tandem.deploy.ray_cluster.cli import add_parser as add_ray_parser

    add_ray_parser(sub)
    return parser


def engine_config(args: argparse.Namespace):
    """EngineConfig from the YAML file (if any) overridden by the flags that were given."""
    from tandem.config import EngineConfig, from_dict, load_yaml, section

    values = {}
    if args.config:  # its engine: section (a serve, Ray or worker file alike)
        data = load_yaml(args.config)
        _refuse_unknown_sections(data, args.config)
        values = dict(section(data, "engine", args.config))
    for flag, field in (
        ("model", "model"),
        ("dtype", "dtype"),
        ("device", "device"),
        ("attention_backend", "attention_backend"),
        ("kv_cache_dtype", "kv_cache_dtype"),
        ("kv_window", "kv_window_tokens"),
        ("kv_sinks", "kv_sink_tokens"),
        ("threads", "num_threads"),
        ("tensor_parallel_size", "tensor_parallel_size"),
    ):
        if getattr(args, flag, None) is not None:
            values[field] = getattr(args, flag)
    config = from_dict(EngineConfig, values, where=args.config or "")
    if getattr(args, "kv_sinks", None) is not None and config.kv_window_tokens is None:
        raise TandemError("--kv-sinks is used only with a KV window (--kv-window, or "
                          "kv_window_tokens in the config)")  # fmt: skip
    return config


def _refuse_unknown_sections(data: dict, where: str) -> None:
    """Only engine: is read, but a key that no Tandem config has (serve, Ray deploy,
    worker or router file) is a typo: ``enigne:`` ran the default model without a word."""
    import dataclasses

    from tandem.config import DecodeConfig, PrefillConfig, RouterConfig
    from tandem.deploy.local import ClusterConfig
    from tandem.deploy.ray_cluster.config import SECTIONS

    known = set(SECTIONS)
    for cls in (ClusterConfig, PrefillConfig, DecodeConfig, RouterConfig):
        known.update(f.name for f in dataclasses.fields(cls))
    unknown = sorted(str(key) for key in data if key not in known)
    if unknown:
        raise ConfigError(
            f"unknown section{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in "
            f"{where}: no serve, Ray, worker or router config has "
            f"{'them' if len(unknown) > 1 else 'it'} (generate reads the engine: section)"
        )


def sampling_params(args: argparse.Namespace):
    from tandem.engine.sampling_params import SamplingParams
    from tandem.wire import DEFAULT_MAX_TOKENS

    return SamplingParams(
        max_tokens=DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    if args.colocated == bool(args.router):
        raise TandemError(
            "generate needs exactly one of --colocated (prefill and decode in this process) "
            "or --router HOST:PORT"
        )
    if not args.prompt.strip():
        from tandem.errors import InvalidRequestError

        raise InvalidRequestError("prompt", "prompt must not be empty")
    params = sampling_params(args)  # validate flags before any model or connection
    _refuse_flags_of_the_other_mode(args)
    if args.router:
        from tandem.config import check_address

        check_address(args.router, "--router", port_required=False)  # the client's, by flag
        return _generate_remote(args.router, args.prompt, args.raw, params,
                                connect=client_kwargs(args),
                                max_tokens_given=args.max_tokens is not None)  # fmt: skip
    from tandem.engine.engine import LLMEngine

    engine = LLMEngine(engine_config(args))
    try:
        tok = engine.tokenizer
        if args.raw:
            prompt_ids = tok.encode(args.prompt)
        else:
            prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
        stats = _Stream()
        for out in engine.stream(prompt_ids, params):
            stats.write(out.text)
        stats.finish(out.num_prompt_tokens, out.num_output_tokens, out.finish_reason.value)
    finally:
        engine.close()
    return 0


# generate's flags that only one of its modes reads: given to the other, they would be
# ignored without a word (a --model that the router does not serve).
_ENGINE_FLAGS = ("model", "dtype", "device", "attention_backend", "kv_cache_dtype", "kv_window",
                 "kv_sinks", "threads", "tensor_parallel_size", "config")  # fmt: skip
_CLIENT_FLAGS = ("tls", "tls_ca", "tls_cert", "tls_key", "api_key_file")


def _refuse_flags_of_the_other_mode(args: argparse.Namespace) -> None:
    unused = _ENGINE_FLAGS if args.router else _CLIENT_FLAGS
    given = [name for name in unused if getattr(args, name, None) not in (None, False)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        where = ("the router's workers run their own engine settings" if args.router
                 else "--colocated connects to no router")  # fmt: skip
        raise TandemError(f"{flag} is not used with {'--router' if args.router else '--colocated'}"
                          f": {where}")  # fmt: skip


def _generate_remote(
    address: str,
    prompt: str,
    raw: bool,
    params,
    timeout=None,
    connect: dict | None = None,
    max_tokens_given: bool = True,
) -> int:
    """Stream one generation through a router (``connect``: client TLS and API key;
    ``max_tokens_given``: False sends it unset, for the router's default)."""
    import dataclasses

    from tandem.client import TandemClient
    from tandem.client._convert import CompletionBuilder

    sampling = {k: v for k, v in dataclasses.asdict(params).items() if k != "stop_token_ids"}
    if not max_tokens_given:
        del sampling["max_tokens"]
    text_input = {"prompt": prompt} if raw else {"messages": [{"role": "user", "content": prompt}]}
    stats = _Stream()
    whole = CompletionBuilder()
    with TandemClient(address, timeout=timeout, **(connect or {})) as client:
        for chunk in client.generate(**text_input, **sampling):
            stats.write(chunk.text)
            whole.add(chunk)
    done = whole.build()  # raises when the stream ended without its final response
    stats.finish(done.usage.prompt_tokens, done.usage.completion_tokens, done.finish_reason)
    if done.finish_reason == "error":  # a worker failed the request after its first tokens
        raise TandemError(f"the generation failed after {done.usage.completion_tokens} tokens")
    return 0


class _Stream:
    """Writes generated text to stdout as it comes; timings to stderr at the end."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None

    def write(self, text: str) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        sys.stdout.write(text)
        sys.stdout.flush()

    def finish(self, prompt_tokens: int, output_tokens: int, finish_reason: str) -> None:
        sys.stdout.write("\n")
        end = time.perf_counter()
        first = self.first or end
        rate = (output_tokens - 1) / (end - first) if end > first else float("nan")
        logging.getLogger("tandem").info(
            "%d prompt + %d output tokens, finish=%s, TTFT %.0f ms, %.1f tok/s decode",
            prompt_tokens, output_tokens, finish_reason, (first - self.start) * 1e3, rate,
        )  # fmt: skip


def cmd_demo(args: argparse.Namespace) -> int:
    """Start a local cluster, stream an answer through it, stop it."""
    import dataclasses
    import signal

    from tandem.deploy.local import LocalCluster

    config = serve_config(args)
    config = dataclasses.replace(config, router=dataclasses.replace(config.router, port=0))
    log = logging.getLogger("tandem")
    log.info(
        "demo: starting %s with %d prefill + %d decode workers (first start dequantises "
        "the model, ~20 s)", config.engine.model, config.num_prefill, config.num_decode,
    )  # fmt: skip
    params = sampling_params(args)
    connect = client_kwargs(args)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # stop in order, as on Ctrl-C
        signal.signal(sig, signal.default_int_handler)
    cluster = LocalCluster(config)
    try:
        with cluster:  # a clean run removes its run dir
            log.info("demo: router on %s; streaming an answer to: %s", cluster.address,
                     args.prompt)  # fmt: skip
            _generate_remote(cluster.address, args.prompt, False, params, timeout=300,
                             connect=connect,
                             max_tokens_given=args.max_tokens is not None)  # fmt: skip
            from tandem.bench.load.cli import demo_load

            demo_load(cluster.address, **connect)
            log.info("demo: stopping the cluster")
    except BaseException:
        if cluster.run_dir.exists():  # gone if the start failed before any process logged
            log.error("demo: the processes' logs are in %s", cluster.run_dir)
        raise
    return 0


def serve_config(args: argparse.Namespace):
    """ClusterConfig from the YAML file (if any) overridden by the flags that were given."""
    import dataclasses

    from tandem.config import load_yaml, section
    from tandem.deploy.local import cluster_config

    values = load_yaml(args.config) if args.config else {}
    where = args.config or ""
    prefill, decode = args.prefill, args.decode
    mode = getattr(args, "disaggregation", None)  # serve's flags; demo has neither
    colocated = getattr(args, "colocated", None)
    if colocated is not None:
        if prefill or decode is not None or mode not in (None, "never"):
            raise ConfigError("--colocated N replaces --prefill, --decode and --disaggregation")
        prefill, decode, mode = 0, colocated, "never"
    # Into the YAML's values, not onto the built config: building it checks the worker
    # counts against the disaggregation mode.
    flags = (("num_prefill", prefill), ("num_decode", decode), ("threads_per_worker", args.threads),
             *((key, getattr(args, key, None)) for key in ("metrics", "log_dir",
               "prefill_tensor_parallel_size", "decode_tensor_parallel_size")))  # fmt: skip
    values.update({key: value for key, value in flags if value is not None})
    if mode is not None:
        router_values = dict(section(values, "router", where))
        disaggregation = section(router_values, "disaggregation", f"{where} router".strip())
        router_values["disaggregation"] = {**disaggregation, "mode": mode}
        values["router"] = router_values
    engine = {k: v for k, v in (("model", args.model),
              ("tensor_parallel_size", getattr(args, "tensor_parallel_size", None)))
              if v is not None}  # fmt: skip
    if engine:
        values["engine"] = {**section(values, "engine", where), **engine}
    cfg = cluster_config(values, where=where)
    given = (("host", args.host), ("port", args.port),
             ("http_port", getattr(args, "http_port", None)))  # fmt: skip
    router = {k: v for k, v in given if v is not None}
    router.update(router_security_settings(args))
    if router:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, **router))
    return cfg


def cmd_serve(args: argparse.Namespace) -> int:
    import signal

    from tandem.deploy.local import LocalCluster
    from tandem.router.public_port import PublicPort
    from tandem.worker import EXIT_REASONS

    config = serve_config(args)
    PublicPort.load(config.router)  # a bad or unsafe setting fails now, not after the workers
    for setting in ("port", "http_port"):  # and a port already taken
        _check_port_free(config.router.host, getattr(config.router, setting), setting)
    router = config.router
    _check_port_free(router.metrics_bind_host, router.metrics_port, "metrics_port")
    if args.log_format:
        from tandem import logs

        os.environ[logs.ENV] = args.log_format  # every process started inherits it
    cluster = LocalCluster(config)
    stopping = []  # set by the handler: a plain flag, no lock a handler could deadlock on

    def on_signal(*_) -> None:
        # During start-up, or on a second signal, stop now: start() (or the interrupted
        # stop()) ends; what it started stops in order or, failing that, on its lifeline.
        if stopping or cluster.address is None:
            raise KeyboardInterrupt
        # The first one once serving: stop in order, draining. Not threading.Event.set():
        # the handler runs in the main thread, which may hold the Event's lock in wait().
        stopping.append(True)

    # SIGHUP too: a closed terminal or a lost ssh session drains as Ctrl-C does (by
    # default it ended the launcher at once, and its children on their lifelines).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    log = logging.getLogger("tandem")
    log.info(
        "starting %d prefill + %d decode workers (%d torch threads each; prefill: %s), "
        "logs in %s",
        config.num_prefill,
        config.num_decode,
        config.worker_threads(),
        {"always": "on the prefill pool", "never": "on the decode workers (colocated)",
         "conditional": "per request"}[config.router.disaggregation.mode],
        cluster.run_dir,
    )  # fmt: skip
    try:
        address = cluster.start()
        print(f"tandem: serving {config.engine.model} on {address}", flush=True)
        if cluster.http_address:
            scheme = "https" if config.router.tls_cert_file else "http"
            print(f"tandem: OpenAI-compatible API on {scheme}://{cluster.http_address}/v1",
                  flush=True)  # fmt: skip
        for name, target in cluster.metrics_targets().items():
            print(f"tandem: {name} metrics on http://{target}/metrics", flush=True)
        if cluster.metrics_targets():
            print(f"tandem: Prometheus file_sd targets in {cluster.run_dir}/"
                  "prometheus-targets.json", flush=True)  # fmt: skip
        code = 0
        while not stopping and not code:
            time.sleep(0.2)  # a signal's handler runs during the sleep
            for proc in cluster.newly_exited():
                why = EXIT_REASONS.get(proc.popen.returncode, "")
                log.error("%s exited with code %d%s; its log: %s", proc.name,
                          proc.popen.returncode, why and f" ({why})", proc.log_path)  # fmt: skip
                if proc.name == "router":  # nothing serves the clients any more
                    code = 1
        log.info("stopping: draining in-flight requests" if not code else "stopping")
    finally:
        cluster.stop()
    return code


def _check_port_free(host: str, port: int | None, setting: str) -> None:
    """ConfigError naming ``setting`` when something listens on ``host:port`` already:
    found before the workers load (a minute with the default model on a first start),
    not when the router starts after them. The router still reports one taken since."""
    import socket

    if not port:  # None: off; 0: a free one
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError:  # the router names a host it cannot resolve
        return
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and uvicorn bind
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(
                f"the router cannot listen on {host}:{port} (setting {setting}): {exc.strerror}"
            ) from None


def cmd_top(args: argparse.Namespace) -> int:
    from tandem.metrics.top import run

    if not math.isfinite(args.interval) or args.interval <= 0:
        raise ConfigError(f"--interval must be a number > 0, got {args.interval}")
    return run(args.target, args.file, args.interval, once=args.once)


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from tandem.bench.engine_throughput import run

    return run(args)


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    from tandem.bench.transfer import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A model may emit any character; never crash on a terminal that cannot show it.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    from tandem import logs

    level = logging.DEBUG if args.verbose else logging.INFO
    json_lines = (getattr(args, "log_format", None) or os.environ.get(logs.ENV)) == "json"
    if json_lines:  # the launcher's own lines too: "decode-0 exited with code 4 ..."
        logs.configure("tandem", level, "json")
    else:
        logging.basicConfig(level=level, stream=sys.stderr, format="tandem: %(message)s")
    # httpx logs every request at INFO: one line per call of an HTTP load run.
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except TandemError as exc:
        if json_lines:
            logging.getLogger("tandem").error("error: %s", exc)
        else:
            print(f"tandem: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
