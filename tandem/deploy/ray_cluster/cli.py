"""``tandem ray up / status / scale / down``: the parser and the commands.

Registered by ``tandem/cli.py`` with ``add_parser``; Ray is imported only when a
command runs, and its absence is a one-line error naming the extra to install.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from tandem import logs
from tandem.argtypes import at_least, port, seconds


def add_parser(sub) -> None:
    ray = sub.add_parser("ray", help="deploy on a Ray cluster: up, status, scale, down")
    cmds = ray.add_subparsers(dest="ray_command", required=True, metavar="RAY_COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", default=None, help="Ray cluster address HOST:PORT")
        p.add_argument(
            "--state-file",
            default=None,
            help="where `up` records the deployment "
            "(default $TANDEM_RAY_STATE or ~/.cache/tandem/ray-state.json)",
        )

    up = cmds.add_parser("up", help="deploy router + pools (starts a local Ray head without "
                         "--address) and print the router address")  # fmt: skip
    common(up)
    up.add_argument("--model", default=None, help="default: smollm2-135m-instruct")
    up.add_argument("--prefill", type=at_least(0), default=None, help="prefill workers (default 1)")
    up.add_argument("--decode", type=at_least(1), default=None, help="decode workers (default 1)")
    up.add_argument("--port", type=port, default=None, help="router port (default 50051)")
    up.add_argument("--config", default=None, help="YAML: engine, router, prefill, decode, ray")
    up.add_argument(
        "--insecure",
        action="store_true",
        help="let the router serve on its non-loopback host without TLS and API keys "
        "(router.insecure; only behind a proxy that does both)",
    )
    up.add_argument(
        "--local-cpus", type=at_least(1), default=8, help="logical CPUs of a local head (default 8)"
    )
    up.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=None,
        help="how the actors log (ray.log_format; default: TANDEM_LOG_FORMAT, else text)",
    )
    up.add_argument(
        "--token-file",
        default=None,
        help="with --address: the cluster's Ray token (deploy/start-head.sh made it); "
        "recorded, so later commands need it no more",
    )
    up.set_defaults(func=cmd_up)

    st = cmds.add_parser("status", help="each pool's workers: node, queue depth, KV use")
    common(st)
    st.add_argument("--json", action="store_true", help="the controller's status as JSON")
    st.set_defaults(func=cmd_status)

    sc = cmds.add_parser("scale", help="set pool sizes; scale-down drains the removed workers")
    common(sc)
    sc.add_argument("--prefill", type=at_least(0), default=None, help="prefill workers")
    sc.add_argument("--decode", type=at_least(0), default=None, help="decode workers")
    sc.set_defaults(func=cmd_scale)

    dn = cmds.add_parser("down", help="stop what `up` started (in-flight streams drain first)")
    common(dn)
    dn.add_argument("--grace", type=seconds, default=30.0, help="seconds for in-flight streams")
    dn.set_defaults(func=cmd_down)


def load_config(args: argparse.Namespace):
    """RayDeployConfig from --config, overridden by the flags that were given."""
    from tandem.config import load_yaml
    from tandem.deploy.ray_cluster.config import deploy_config

    cfg = deploy_config(load_yaml(args.config) if args.config else {}, where=args.config or "")
    changes: dict[str, Any] = {}
    if args.model is not None:
        changes["engine"] = dataclasses.replace(cfg.engine, model=args.model)
    router = {k: v for k, v in (("port", args.port), ("insecure", args.insecure or None))
              if v is not None}  # fmt: skip
    if router:
        changes["router"] = dataclasses.replace(cfg.router, **router)
    for flag, name in (("prefill", "prefill_pool"), ("decode", "decode_pool")):
        if getattr(args, flag) is not None:
            changes[name] = dataclasses.replace(getattr(cfg, name), replicas=getattr(args, flag))
    # The flag, else ray.log_format, else this process's TANDEM_LOG_FORMAT, else text.
    changes["log_format"] = logs.log_format(getattr(args, "log_format", None) or cfg.log_format)
    return dataclasses.replace(cfg, **changes)


def _state_file(args: argparse.Namespace):
    from tandem.deploy.ray_cluster.head import state_path

    return state_path(args.state_file)


def cmd_up(args: argparse.Namespace) -> int:
    from tandem.deploy.ray_cluster.launch import up

    config = load_config(args)
    state = up(
        config,
        args.address,
        _state_file(args),
        local_cpus=args.local_cpus,
        token_file=args.token_file,
    )
    where = "a local Ray head" if state.get("head_pid") else "Ray"
    print(f"tandem: serving {config.engine.model} on {state['router']} "
          f"({where} at {state['address']}, namespace {config.namespace})", flush=True)  # fmt: skip
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from tandem.deploy.ray_cluster.launch import status

    st = status(_state_file(args), args.address)
    if args.json:
        import json

        print(json.dumps(st, indent=2))
        return 0
    print(format_status(st))
    return 0


def format_status(st: dict[str, Any]) -> str:
    t = st["targets"]
    ctrl = st.get("controller", {})
    lines = [
        f"router  {st['router']} (node {st['router_node']})"
        + (f"  metrics {st['router_metrics']}" if st.get("router_metrics") else ""),
        f"controller pid {ctrl.get('pid', '-')} on node {ctrl.get('node_id', '-')[:12]}",
        f"targets prefill={t['prefill']} decode={t['decode']}  "
        f"autoscale={'on' if st['autoscale'] else 'off'}",
        "",
        f"{'POOL':8} {'WORKER':11} {'STATE':10} {'NODE':16} {'NODE ID':12} {'ADDRESS':22} "
        f"{'QUEUE':>5} {'RUN':>4} {'KV USE':>12} {'SERVED':>7} {'RESTARTS':>8}",
    ]
    for w in st["workers"]:
        total = w.get("kv_blocks_total", 0)
        kv = f"{w.get('kv_blocks_used', 0)}/{total}" if total else "-"
        if total:
            kv += f" {100 * w['kv_blocks_used'] / total:.0f}%"
        lines.append(
            f"{w['pool']:8} {w['name']:11} {w['state']:10} {w.get('node_ip', '-'):16} "
            f"{w.get('node_id', '-')[:12]:12} {w.get('address', '-'):22} "
            f"{w.get('queue_depth', '-'):>5} "
            f"{w.get('running', '-'):>4} {kv:>12} {w.get('served', '-'):>7} {w['restarts']:>8}"
        )
    for pool, p in st.get("pools", {}).items():
        if p["waiting"]:
            lines.append(f"{pool}: {p['serving']} of {p['target']} serving; {p['waiting']}")
    if st.get("metrics_targets_file"):
        lines += ["", f"metrics: Prometheus file_sd targets in {st['metrics_targets_file']} "
                      f"(on the controller's node); tandem top --file it"]  # fmt: skip
    if st.get("events"):
        lines += ["", "recent events:"] + [f"  {e}" for e in st["events"][-8:]]
    return "\n".join(lines)


def cmd_scale(args: argparse.Namespace) -> int:
    from tandem.deploy.ray_cluster.launch import scale
    from tandem.errors import ConfigError

    if args.prefill is None and args.decode is None:
        raise ConfigError("scale needs --prefill N and/or --decode M")
    st = scale(_state_file(args), args.prefill, args.decode, args.address)
    print(format_status(st))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from tandem.deploy.ray_cluster.launch import down

    stopped = down(_state_file(args), args.address, args.grace)
    for what in stopped or ["nothing was running"]:
        print(f"tandem: stopped {what}", file=sys.stderr)
    return 0
