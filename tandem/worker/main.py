"""The worker process entry: ``python -m tandem.prefill_worker`` / ``tandem.decode_worker``.

    --config FILE      a role config as YAML (``engine:`` nests; what the launcher writes)
    --model, --port, --kv-backend, ...   one flag per config field, overriding the file
    --cluster-ca-file, --cluster-cert-file, --cluster-key-file, --cluster-kv-secret-file
                       the cluster credentials (files; see tandem/security/cluster.py)

Once serving it prints one line on stdout, which the launcher waits for:

    READY prefill grpc=127.0.0.1:40123 kv=- metrics=-
    READY decode grpc=127.0.0.1:40125 kv=127.0.0.1:40127 metrics=127.0.0.1:40129

SIGTERM / SIGINT: NOT_SERVING, no new requests, in-flight ones get
``drain_timeout_s``, exit 0. Bad flags or config: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal

from tandem import logs
from tandem.config import (
    ClusterSecurityConfig,
    DecodeConfig,
    EngineConfig,
    PrefillConfig,
    load_yaml,
    role_config,
    section,
)
from tandem.errors import TandemError
from tandem.kv_transfer.ucx.runtime import on_gpu, ucx_env_defaults

EXIT_USAGE = 2
ROLES = {"prefill": PrefillConfig, "decode": DecodeConfig}
_ENGINE_FLAGS = ("model", "dtype", "device", "num_blocks", "kv_cache_bytes",
                 "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "cache_dir")  # fmt: skip


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _boolean(text: str) -> bool:
    """A bool flag's value, as YAML spells it."""
    words = {"true": True, "yes": True, "on": True, "1": True,
             "false": False, "no": False, "off": False, "0": False}  # fmt: skip
    if text.lower() not in words:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return words[text.lower()]


def _field_type(cls: type, name: str):
    default = next(f for f in dataclasses.fields(cls) if f.name == name)
    value = default.default
    if isinstance(value, bool):
        return _boolean
    if value is None or value is dataclasses.MISSING:
        ints = ("num_threads", "num_blocks", "max_model_len", "metrics_port")
        return int if name in ints else str
    return type(value)


def build_parser(role: str) -> argparse.ArgumentParser:
    cls = ROLES[role]
    p = argparse.ArgumentParser(
        prog=f"python -m tandem.{role}_worker",
        description=f"A Tandem {role} worker (gRPC server; prints READY when serving).",
    )
    p.add_argument("--config", help="YAML role config (engine: nests); flags override it")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    for f in dataclasses.fields(cls):
        if f.name not in ("engine", "cluster"):
            p.add_argument(
                _flag(f.name), dest=f.name, metavar=f.name.upper(), type=_field_type(cls, f.name)
            )
    g = p.add_argument_group("engine")
    for name in _ENGINE_FLAGS:
        g.add_argument(
            _flag(name),
            dest=f"engine.{name}",
            metavar=name.upper(),
            type=_field_type(EngineConfig, name),
        )
    g.add_argument(
        "--threads", dest="engine.num_threads", metavar="N", type=int, help="torch threads"
    )
    c = p.add_argument_group("cluster security")
    for f in dataclasses.fields(ClusterSecurityConfig):
        flag, dest = _flag("cluster_" + f.name), f"cluster.{f.name}"
        if f.type in (bool, "bool"):
            c.add_argument(flag, dest=dest, action="store_true", default=None)
        else:
            c.add_argument(flag, dest=dest, metavar=f.name.upper())
    return p


def load_config(role: str, args: argparse.Namespace) -> PrefillConfig | DecodeConfig:
    values = dict(load_yaml(args.config)) if args.config else {}
    where = args.config or "flags"
    nested = {name: dict(section(values, name, where)) for name in ("engine", "cluster")}
    for key, value in vars(args).items():
        if value is None or key in ("config", "verbose"):
            continue
        part, _, field = key.rpartition(".")
        if part:
            nested[part][field] = value
        else:
            values[key] = value
    values.update(nested)
    return role_config(ROLES[role], values, where=args.config or "flags")


async def serve(role: str, config: PrefillConfig | DecodeConfig) -> int:
    if role == "prefill":
        from tandem.prefill_worker.server import PrefillServer as Server
    else:
        from tandem.decode_worker.server import DecodeServer as Server
    server = Server(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"READY {role} grpc={server.address} kv={server.kv_address or '-'} "
        f"metrics={server.metrics_address or '-'}",
        flush=True,
    )
    await stop.wait()
    logging.getLogger("tandem").info("%s worker: draining", role)
    await server.stop()
    return 0


def main(role: str, argv: list[str] | None = None) -> int:
    args = build_parser(role).parse_args(argv)
    try:
        logs.configure(role, logging.DEBUG if args.verbose else logging.INFO)
        config = load_config(role, args)
        ucx_env_defaults(cuda=on_gpu(config.engine.device), host=config.host)  # before UCX starts
        if config.engine.num_threads:  # before torch spins up its pools (the engine does too)
            import torch

            torch.set_num_threads(config.engine.num_threads)
        return asyncio.run(serve(role, config))
    except TandemError as exc:
        logs.fatal(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # its traceback, in the log's own format
        logs.fatal(f"{role} worker failed: {exc!r}", exc_info=True)
        return 1
