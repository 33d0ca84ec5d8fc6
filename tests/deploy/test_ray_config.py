"""The Ray deployment's pieces that need no Ray: config, actor options, the
controller's autoscaling and removal choices, the CLI's parser and status table."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest
import yaml

from tandem.cli import build_parser
from tandem.deploy.autoscale import AutoscaleConfig, PoolPolicy
from tandem.deploy.ray_cluster.cli import format_status, load_config
from tandem.deploy.ray_cluster.config import ActorResources, RayDeployConfig, deploy_config
from tandem.deploy.ray_cluster.controller import Controller, _Worker
from tandem.deploy.ray_cluster.launch import _local_resources
from tandem.deploy.ray_cluster.placement import actor_options
from tandem.errors import ConfigError

YAML = """
engine: {model: tiny-random, num_blocks: 64, max_model_len: 512}
router: {port: 6000}
decode: {kv_lease_s: 12}
ray:
  namespace: prod
  prefill: {replicas: 2, num_cpus: 8, num_gpus: 1}
  decode: {replicas: 3, num_cpus: 4, num_gpus: 2, resources: {decode: 1, a100: 1}}
  autoscale: {enabled: true, interval_s: 2, decode: {max_replicas: 6}}
"""


def test_yaml_sections_map_onto_the_deploy_config():
    cfg = deploy_config(yaml.safe_load(YAML), where="ray.yaml")
    assert cfg.namespace == "prod" and cfg.engine.model == "tiny-random"
    assert cfg.router.port == 6000 and cfg.router.host == "0.0.0.0"  # reachable off the node
    assert cfg.prefill_pool.resources == {"prefill": 1}  # the pool's resource by default
    assert cfg.decode_pool.resources == {"decode": 1, "a100": 1}
    assert cfg.autoscale.enabled and cfg.autoscale.interval_s == 2
    assert cfg.autoscale.decode == PoolPolicy(min_replicas=1, max_replicas=6, target=0.7)
    decode = cfg.worker_config("decode", host="10.0.0.5")
    assert (decode.host, decode.port, decode.kv_port, decode.kv_lease_s) == ("10.0.0.5", 0, 0, 12)
    assert decode.engine.num_threads == 4  # the worker's CPU share is its thread budget
    router = cfg.router_config()
    assert router.model == "tiny-random" and router.decode_workers == ()
    assert router.max_model_len == 512  # the workers' context


@pytest.mark.parametrize(
    "values, message",
    [
        ({"ray": {"decode": {"replicas": 0}}}, "needs >= 1 decode worker"),
        ({"ray": {"prefill": {"replicas": 0}}}, "no prefill worker needs router.disaggregation"),
        ({"router": {"disaggregation": {"mode": "never"}}}, "set ray.prefill.replicas 0"),
        ({"ray": {"decode": {"strategy": "PACKED"}}}, "strategy must be one of SPREAD"),
        ({"ray": {"decode": {"resources": {"GPU": 1}}}}, "custom resources must be named"),
        ({"ray": {"decode": {"gpus": 1}}}, "unknown setting gpus"),
        ({"ray": {"autoscale": {"decode": {"target": 2}}}}, "KV utilisation in"),
        ({"rayy": {}}, "unknown section rayy"),
        ({"engine": {"block_size": 3}}, "block_size must be a power of two"),
        # The first round would have drained 7 of 9 at once, or forced 0 prefill to 1.
        (
            {
                "ray": {
                    "decode": {"replicas": 9},
                    "autoscale": {"enabled": True, "decode": {"max_replicas": 2}},
                }
            },
            r"ray.decode.replicas 9 is outside the autoscaling bounds \[1, 2\]",
        ),
        (
            {
                "router": {"disaggregation": {"mode": "conditional"}},
                "ray": {"prefill": {"replicas": 0}, "autoscale": {"enabled": True}},
            },
            r"ray.prefill.replicas 0 is outside .* \(ray.autoscale.prefill.min_replicas",
        ),
        (
            {"ray": {"monitor_interval_s": float("nan")}},
            "monitor_interval_s must be a finite number",
        ),
        # These started a head and failed in a worker's start, naming no setting.
        ({"ray": {"decode": {"num_cpus": float("inf")}}}, "num_cpus must be a finite number"),
        ({"ray": {"decode": {"resources": {"d": float("nan")}}}}, "finite and >= 0, got d: nan"),
        (
            {"ray": {"autoscale": {"prefill": {"bogus": 1}}}},
            r"unknown setting bogus in .* "
            r"ray.autoscale.prefill",
        ),
    ],
)
def test_bad_settings_fail_with_the_setting_named(values, message):
    with pytest.raises(ConfigError, match=message):
        deploy_config(values, where="ray.yaml")


def test_actor_options_ask_for_resources_and_spread_and_restart():
    res = ActorResources(num_cpus=4, num_gpus=1, resources={"decode": 1})
    assert actor_options(res) == {
        "num_cpus": 4,
        "num_gpus": 1,
        "resources": {"decode": 1},
        "scheduling_strategy": "SPREAD",
        "max_restarts": -1,
    }
    assert not res.uses_placement_group
    multi = ActorResources(num_cpus=8, num_gpus=2, resources={"prefill": 1})
    assert multi.uses_placement_group  # several devices: reserved together on one node
    assert multi.bundle() == {"CPU": 8, "GPU": 2, "prefill": 1}
    assert ActorResources(num_cpus=0.5).bundle() == {"CPU": 0.5}


def test_a_tensor_parallel_pool_reserves_every_ranks_devices_in_one_bundle():
    cfg = deploy_config(
        {
            "router": {"disaggregation": {"mode": "never"}},
            "ray": {
                "prefill": {"replicas": 0},
                "decode": {"num_cpus": 4, "num_gpus": 1, "tensor_parallel_size": 2},
            },
        }  # fmt: skip
    )
    res = cfg.decode_pool
    assert res.uses_placement_group and res.bundle() == {"CPU": 8, "GPU": 2, "decode": 1}
    assert actor_options(res)["num_gpus"] == 2
    engine = cfg.worker_config("decode", host="10.0.0.5").engine
    assert (engine.tensor_parallel_size, engine.num_threads) == (2, 4)  # threads per rank


@pytest.mark.parametrize(
    "values, message",
    [
        ({"engine": {"tensor_parallel_size": 2}}, "set ray.decode.tensor_parallel_size"),
        ({"ray": {"decode": {"tensor_parallel_size": 0}}}, "tensor_parallel_size must be >= 1"),
    ],
)
def test_tensor_parallel_settings_the_deployment_cannot_run_are_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        deploy_config(values, where="ray.yaml")


def test_a_local_head_gets_the_custom_resources_every_pool_can_grow_to():
    cfg = RayDeployConfig(
        decode_pool=ActorResources(replicas=2, resources={"decode": 1}),
        autoscale=AutoscaleConfig(decode=PoolPolicy(max_replicas=5, target=0.5)),
    )
    # One spare each: a scale-up starts the new worker before a drain ends.
    assert _local_resources(cfg) == {"prefill": 5, "decode": 6}


def _controller(**autoscale) -> Controller:
    policy = AutoscaleConfig(
        enabled=True,
        prefill=PoolPolicy(max_replicas=4, target=2.0),
        decode=PoolPolicy(max_replicas=4, target=0.5),
        scale_up_cooldown_s=0,
        scale_down_cooldown_s=0,
        scale_down_window_s=0,
        **autoscale,
    )
    ctrl = Controller(RayDeployConfig(autoscale=policy))
    ctrl.reconciled = []

    async def reconcile(pools=("prefill", "decode")):
        ctrl.reconciled.append({pool: ctrl.targets[pool] for pool in pools})

    ctrl._reconcile = reconcile
    return ctrl


def _autoscale(ctrl: Controller) -> None:
    """One autoscale round, and the resizes it started in the background."""

    async def round_and_resizes():
        await ctrl._autoscale_once()
        await asyncio.gather(*ctrl._resizes.values())

    asyncio.run(round_and_resizes())


def _add(ctrl: Controller, name: str, **stats) -> _Worker:
    pool = name.split("-")[0]
    w = _Worker(name, pool, handle=None, state="serving", stats=stats)
    ctrl.workers[name] = w
    return w


def test_the_controller_feeds_queue_depth_and_kv_use_to_the_policy():
    ctrl = _controller()
    _add(ctrl, "prefill-0", queue_depth=6, running=2, kv_blocks_used=0, kv_blocks_total=100)
    _add(ctrl, "decode-1", queue_depth=0, running=9, kv_blocks_used=90, kv_blocks_total=100)
    _autoscale(ctrl)
    # queue 6 vs 2 per worker -> 3; KV 0.9 vs 0.5 -> 2; each pool resized on its own
    assert sorted(ctrl.reconciled, key=list) == [{"decode": 2}, {"prefill": 3}]
    assert any("autoscale prefill: 1 -> 3" in e for e in ctrl.events)


def test_the_controller_leaves_pools_alone_near_target_and_without_numbers():
    ctrl = _controller()
    _add(ctrl, "prefill-0", queue_depth=2, kv_blocks_used=0, kv_blocks_total=100)
    _add(ctrl, "decode-1")  # no stats yet: still starting
    _autoscale(ctrl)
    assert ctrl.reconciled == []


def test_scale_down_picks_the_least_busy_worker_then_the_newest():
    ws = [
        _Worker("decode-1", "decode", None, stats={"running": 1, "queue_depth": 0}),
        _Worker("decode-2", "decode", None, stats={"running": 0, "queue_depth": 0}),
        _Worker("decode-3", "decode", None, stats={"running": 0, "queue_depth": 0}),
        _Worker("decode-4", "decode", None, stats={"running": 3, "queue_depth": 1}),
    ]
    assert [w.name for w in Controller._pick_for_removal(ws, 2)] == ["decode-3", "decode-2"]
    assert Controller._pick_for_removal(ws, 0) == []


def test_manual_scale_outside_the_autoscaling_bounds_is_refused():
    ctrl = _controller()
    with pytest.raises(ConfigError, match=r"--decode 9 is outside the autoscaling bounds \[1, 4\]"):
        asyncio.run(ctrl.scale(decode=9))
    with pytest.raises(ConfigError, match="--prefill must be >= 1, got 0"):
        asyncio.run(ctrl.scale(prefill=0))


def test_ray_subcommands_parse_and_flags_override_the_file(tmp_path):
    path = tmp_path / "ray.yaml"
    path.write_text(YAML)
    args = build_parser().parse_args(
        ["ray", "up", "--config", str(path), "--decode", "5", "--model", "m", "--port", "7000"]
    )
    cfg = load_config(args)
    assert (cfg.decode_pool.replicas, cfg.prefill_pool.replicas) == (5, 2)
    assert cfg.decode_pool.num_gpus == 2 and cfg.engine.model == "m" and cfg.router.port == 7000
    assert not cfg.router.insecure
    assert load_config(build_parser().parse_args(["ray", "up", "--insecure"])).router.insecure
    args = build_parser().parse_args(["ray", "scale", "--prefill", "3", "--address", "h:1"])
    assert (args.prefill, args.decode, args.address) == (3, None, "h:1")


def test_status_table_shows_node_queue_and_kv_use():
    text = format_status(
        {
            "router": "10.0.0.1:50051",
            "router_node": "10.0.0.1",
            "targets": {"prefill": 1, "decode": 1},
            "autoscale": False,
            "workers": [
                {
                    "pool": "decode",
                    "name": "decode-1",
                    "state": "serving",
                    "node_ip": "10.0.0.7",
                    "address": "10.0.0.7:4100",
                    "queue_depth": 2,
                    "running": 5,
                    "kv_blocks_used": 64,
                    "kv_blocks_total": 256,
                    "served": 40,
                    "restarts": 1,
                },
                {"pool": "prefill", "name": "prefill-0", "state": "starting", "restarts": 0},
            ],  # fmt: skip
            "events": ["12:00:00 decode-1 serving"],
        }
    )
    assert "64/256 25%" in text and "10.0.0.7" in text and "autoscale=off" in text
    assert "prefill-0   starting" in text and "decode-1 serving" in text


def test_the_shipped_deploy_files_agree_with_each_other():
    from pathlib import Path

    from tandem.config import load_yaml

    root = Path(__file__).resolve().parents[2] / "deploy"
    cfg = deploy_config(load_yaml(root / "tandem-ray.yaml"), where="deploy/tandem-ray.yaml")
    cluster = yaml.safe_load((root / "cluster.yaml").read_text())
    types = cluster["available_node_types"]
    assert types[cluster["head_node_type"]]["resources"] == {}  # no worker on the head
    for pool in ("prefill", "decode"):
        res = cfg.pool(pool).resources
        assert res == {pool: 1}
        # The node type of that name offers the pool's resource, and no other type does.
        assert [name for name, t in types.items() if pool in t["resources"]] == [pool]
    # Each node's setup installs the mounted checkout: its pip arguments as a shell
    # (Ray's) gives them ('~/tandem[ray]' in quotes reached pip as a literal ~).
    installs = [c for c in cluster["setup_commands"] if "pip install" in c]
    args = subprocess.run(
        ["bash", "-c", "; ".join(c.replace("python3 -m pip install", "printf '%s\\n'")
                                 for c in installs)],
        env={"HOME": "/home/ray", "PATH": os.environ["PATH"]}, capture_output=True, text=True,
        check=True,
    ).stdout.split()  # fmt: skip
    assert "/home/ray/tandem[ray]" in args and not [a for a in args if "~" in a]


def test_the_router_runs_on_the_head_unless_its_resources_say_otherwise():
    head = {"node:__internal_head__": 0.001}
    assert RayDeployConfig().router_actor.resources == head
    cfg = deploy_config({"ray": {"router": {"num_cpus": 2}}})
    assert cfg.router_actor.resources == head and cfg.router_actor.num_cpus == 2
    anywhere = deploy_config({"ray": {"router": {"resources": {}, "strategy": "SPREAD"}}})
    assert anywhere.router_actor.resources == {}
    # Ray's per-node resource is not one a local head is started with.
    assert "node:__internal_head__" not in _local_resources(cfg)


def test_the_autoscaler_leaves_a_resizing_pool_alone_and_sizes_the_other():
    # Its numbers do not show the resize yet; and one start may wait for a node for
    # startup_timeout_s (600 s), during which every round used to return at once,
    # whatever the other pool's load.
    ctrl = _controller()
    _add(ctrl, "prefill-0", queue_depth=6, running=2, kv_blocks_used=0, kv_blocks_total=100)
    _add(ctrl, "decode-1", queue_depth=0, running=9, kv_blocks_used=90, kv_blocks_total=100)

    async def during_a_resize():
        ctrl._scaling.add("decode")  # a `scale --decode` whose worker waits for a node
        await ctrl._autoscale_once()
        await asyncio.gather(*ctrl._resizes.values())
        assert ctrl.reconciled == [{"prefill": 3}] and ctrl.targets["decode"] == 1
        ctrl._scaling.clear()
        ctrl.workers["prefill-0"].stats["queue_depth"] = 2  # at its target now
        await ctrl._autoscale_once()
        await asyncio.gather(*ctrl._resizes.values())

    asyncio.run(during_a_resize())
    assert ctrl.reconciled == [{"prefill": 3}, {"decode": 2}]  # decode: the round after


def test_a_worker_that_stopped_answering_is_not_counted_in_its_pools_load():
    # Its last numbers (a queue of 20) are a dead or restarting process's: they grew
    # the pool on their own, while the live worker sat at its target.
    ctrl = _controller()
    ctrl.targets["prefill"] = 2
    _add(ctrl, "prefill-0", queue_depth=20, kv_blocks_used=0, kv_blocks_total=100).answering = False
    _add(ctrl, "prefill-1", queue_depth=2, kv_blocks_used=0, kv_blocks_total=100)
    _add(ctrl, "decode-2", kv_blocks_used=50, kv_blocks_total=100)
    _autoscale(ctrl)
    assert ctrl.reconciled == []


def test_pools_of_the_same_width_may_be_disaggregated():
    both = {"tensor_parallel_size": 2}
    cfg = deploy_config({"ray": {"prefill": both, "decode": both}})
    assert cfg.worker_config("prefill", host="10.0.0.5").engine.tensor_parallel_size == 2


def test_the_log_format_reaches_the_actors_from_the_flag_the_file_or_the_environment(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("TANDEM_LOG_FORMAT", raising=False)

    def fmt(*argv, config=""):
        extra = ["--config", str(config)] if config else []
        return load_config(build_parser().parse_args(["ray", "up", *extra, *argv])).log_format

    assert fmt() == "text"
    path = tmp_path / "ray.yaml"
    path.write_text("ray: {log_format: json}\n")
    assert fmt(config=path) == "json"
    assert fmt("--log-format", "text", config=path) == "text"  # the flag wins
    monkeypatch.setenv("TANDEM_LOG_FORMAT", "json")  # as for `tandem serve`
    assert fmt() == "json"
    path.write_text("ray: {log_format: xml}\n")
    with pytest.raises(ConfigError, match="ray.log_format must be one of text, json, got 'xml'"):
        fmt(config=path)


def test_an_actor_logs_json_lines_when_told(capsys):
    import json
    import logging

    from tandem.deploy.ray_cluster.actors import _setup_process

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        _setup_process("decode", "json")
        logging.getLogger("tandem.test").info("hello")
        line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
        assert (line["process"], line["message"]) == ("decode", "hello")
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
