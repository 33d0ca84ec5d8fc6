"""``python -m tandem.router``: the router as a process.

    python -m tandem.router --config router.yaml
    python -m tandem.router --model tiny-random --port 50051 \\
        --prefill 127.0.0.1:50061 --decode 127.0.0.1:50071
    python -m tandem.router --config router.yaml --host 0.0.0.0 \\
        --tls-cert router.pem --tls-key router-key.pem --api-keys-file keys.txt

Flags override the YAML (a mapping of ``RouterConfig`` fields). Prints
``READY router grpc=HOST:PORT metrics=HOST:PORT|- http=HOST:PORT|-`` on stdout
once it serves; on SIGTERM or SIGINT it stops accepting, drains in-flight
requests for up to ``drain_timeout_s`` and exits 0. A bad setting exits 2 with
the setting named, and so does a host that is not loopback without TLS and
authentication (API keys or a client CA) unless ``--insecure`` is given
(tandem/router/public_port.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys

from tandem import logs
from tandem.cli import add_router_security_flags, router_security_settings
from tandem.config import RouterConfig, load_yaml, role_config
from tandem.errors import ConfigError
from tandem.router.server import Router

log = logging.getLogger("tandem.router")


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    parser = argparse.ArgumentParser(prog="python -m tandem.router", description=__doc__)
    parser.add_argument("--config", help="YAML file of RouterConfig fields")
    parser.add_argument("--model", help="model for the tokenizer and limits")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--metrics-port", type=int, help="Prometheus metrics (0: a free port)")
    parser.add_argument("--http-port", type=int, help="OpenAI-compatible API (0: a free port)")
    parser.add_argument("--prefill", action="append", help="prefill worker host:port (repeat)")
    parser.add_argument("--decode", action="append", help="decode worker host:port (repeat)")
    parser.add_argument("--placement", help="least-loaded, round-robin or prefix-aware")
    parser.add_argument("--max-queue", type=int, help="in-flight bound (then RESOURCE_EXHAUSTED)")
    add_router_security_flags(parser)
    args = parser.parse_args(argv)
    values = dict(load_yaml(args.config)) if args.config else {}
    config = role_config(RouterConfig, values, where=args.config or "")
    flags = {
        "model": args.model,
        "host": args.host,
        "port": args.port,
        "metrics_port": args.metrics_port,
        "http_port": args.http_port,
        "prefill_workers": tuple(args.prefill) if args.prefill else None,
        "decode_workers": tuple(args.decode) if args.decode else None,
        "placement": args.placement,
        "max_queue": args.max_queue,
        **router_security_settings(args),
    }
    return dataclasses.replace(config, **{k: v for k, v in flags.items() if v is not None})


async def serve(config: RouterConfig) -> None:
    router = Router(config)
    await router.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"READY router grpc={router.address} metrics={router.metrics_address or '-'} "
          f"http={router.http_address or '-'}", flush=True)  # fmt: skip
    await stop.wait()
    log.info("draining (up to %g s)", config.drain_timeout_s)
    await router.stop()


def main(argv: list[str] | None = None) -> int:
    try:
        logs.configure("router")
        config = parse_config(argv)
        asyncio.run(serve(config))
    except ConfigError as exc:
        logs.fatal(str(exc))
        return 2
    except Exception as exc:  # its traceback, in the log's own format
        logs.fatal(f"router failed: {exc!r}", exc_info=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
