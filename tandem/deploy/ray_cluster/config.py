"""What ``tandem ray up`` deploys: role configs, per-pool Ray resources, autoscaling.

YAML (every section optional; role sections are the same as for ``tandem serve``):

    engine:  {model: smollm2-135m-instruct}     # EngineConfig, for every worker
    router:  {port: 50051}                      # RouterConfig (workers are filled in)
    prefill: {kv_backend: ucx}                  # PrefillConfig (engine, host, port replaced)
    decode:  {kv_lease_s: 30}                   # DecodeConfig (engine, host, ports replaced)
    cluster: {ca_file: ..., cert_file: ..., key_file: ..., kv_secret_file: ...}
                                                # files on the launching machine; default:
                                                # `up` makes a throw-away set
    ray:
      namespace: tandem
      prefill: {replicas: 2, num_cpus: 8, num_gpus: 1, resources: {prefill: 1}}
      decode:  {replicas: 2, num_cpus: 8, num_gpus: 1, resources: {decode: 1}}
      router:  {num_cpus: 1}                    # on the head node unless resources are given
      autoscale: {enabled: true, prefill: {max_replicas: 8, target: 2}, ...}
      metrics: true                             # every actor serves Prometheus metrics;
      metrics_targets_file: /etc/prometheus/tandem.json   # kept current by the controller

Placement: each worker asks for ``num_cpus``, ``num_gpus`` and its pool's custom
resources, so an operator dedicates node types to a pool by giving those nodes
the resource (``ray start --resources '{"prefill": 1}'``). A pool's workers are
spread over the nodes that qualify (``strategy: SPREAD``). A worker that needs
several GPUs gets a placement group of one STRICT_PACK bundle: its devices are
reserved on one node together, and stay reserved for it across restarts.
``tensor_parallel_size: N`` in a pool's section makes each of its workers N ranks
(the pools' widths may differ: a decode worker re-splits the heads it reads), with
``num_cpus``/``num_gpus`` per rank: the bundle holds all N ranks' devices. One
bundle, not one per rank: the other ranks are the actor's child processes (so they
start, die and restart with it), and Ray makes a bundle's GPUs visible only to the
actor placed in it.
Security inside: ``tandem ray up`` reads the ``cluster:`` files (or creates a
throw-away CA, member certificate and KV secret) and hands the bytes to the
controller, which passes them to every router and worker actor as an argument:
through Ray, never through a log, a file on the worker nodes or a command line.
The router calls the workers over mutual TLS; the workers authenticate their
KV connections. ``cluster: {insecure: true}`` turns this off.
The router runs on the head node (Ray's ``node:__internal_head__`` resource), as
the controller does, so its address is the head's; ``ray.router.resources``
places it elsewhere (``{}``: any node).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tandem import logs
from tandem.config import (
    ClusterSecurityConfig,
    DecodeConfig,
    EngineConfig,
    PrefillConfig,
    RouterConfig,
    from_dict,
    refuse_launcher_settings,
    role_config,
    router_context,
    section,
)
from tandem.deploy.autoscale import AutoscaleConfig, PoolPolicy
from tandem.errors import ConfigError

STRATEGIES = ("SPREAD", "DEFAULT")
# Ray gives every head node this resource (1 unit); a tiny share pins an actor there.
HEAD_NODE = {"node:__internal_head__": 0.001}


@dataclass(frozen=True)
class ActorResources:
    """What one actor asks Ray for, and how it is placed and restarted."""

    replicas: int = 1  # workers at start (ignored for the router)
    num_cpus: float = 1.0  # also the worker's torch thread budget (at least 1)
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom, e.g. {"decode": 1}
    strategy: str = "SPREAD"  # across nodes; DEFAULT lets Ray pack them
    placement_group: bool | None = None  # None: when the worker needs > 1 GPU
    max_restarts: int = -1  # Ray restarts a crashed actor; -1: without limit
    # Ranks per worker (tandem/engine/parallel.py); num_cpus and num_gpus are per rank.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "resources", dict(self.resources))
        if self.replicas < 0:
            raise ConfigError(f"replicas must be >= 0, got {self.replicas}")
        if not (0 <= self.num_cpus < math.inf and 0 <= self.num_gpus < math.inf):
            raise ConfigError(f"num_cpus and num_gpus must be finite and >= 0, got "
                              f"{self.num_cpus}, {self.num_gpus}")  # fmt: skip
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU") or not 0 <= amount < math.inf:
                raise ConfigError(
                    f"resources: custom resources must be named (not CPU/GPU) and finite "
                    f"and >= 0, got {name}: {amount}"
                )
        if self.max_restarts < -1:
            raise ConfigError(f"max_restarts must be >= -1, got {self.max_restarts}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")

    @property
    def worker_cpus(self) -> float:
        """CPUs of one worker: every rank's."""
        return self.num_cpus * self.tensor_parallel_size

    @property
    def worker_gpus(self) -> float:
        return self.num_gpus * self.tensor_parallel_size

    @property
    def uses_placement_group(self) -> bool:
        if self.placement_group is None:
            return self.worker_gpus > 1
        return self.placement_group

    def bundle(self) -> dict[str, float]:
        """The resources of one actor (all its ranks), as a placement-group bundle or a
        request to the Ray autoscaler."""
        bundle = {"CPU": self.worker_cpus, **self.resources}
        if self.num_gpus:
            bundle["GPU"] = self.worker_gpus
        return {k: v for k, v in bundle.items() if v}


@dataclass(frozen=True)
class RayDeployConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterConfig = field(default_factory=lambda: RouterConfig(host="0.0.0.0"))
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    cluster: ClusterSecurityConfig = field(default_factory=ClusterSecurityConfig)
    namespace: str = "tandem"
    prefill_pool: ActorResources = field(
        default_factory=lambda: ActorResources(resources={"prefill": 1})
    )
    decode_pool: ActorResources = field(
        default_factory=lambda: ActorResources(resources={"decode": 1})
    )
    router_actor: ActorResources = field(
        default_factory=lambda: ActorResources(resources=HEAD_NODE, strategy="DEFAULT")
    )
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    startup_timeout_s: float = 600.0  # a worker not serving by then is given up (nodes may boot)
    router_timeout_s: float = 120.0  # `up` fails when the router is not serving by then
    monitor_interval_s: float = 1.0  # how often the controller checks its actors
    drain_timeout_s: float = 30.0  # a worker removed by scale-down finishes its requests in this
    request_nodes: bool = True  # tell Ray's autoscaler the pools' resource needs
    # Every router and worker actor serves Prometheus metrics on a free port (a role
    # section's own metrics_port wins), and the controller keeps a file_sd targets file
    # current on its node (the head): metrics_targets_file, default
    # <tmp>/tandem-<namespace>-targets.json. `tandem ray status` names it.
    metrics: bool = False
    metrics_targets_file: str = ""
    # How the controller, router and worker actors log: "text", or "json" (one object a
    # line, tandem/logs.py); "": as `tandem ray up`'s own TANDEM_LOG_FORMAT says (it
    # resolves it, and --log-format wins), as `tandem serve` passes it to its processes.
    log_format: str = ""

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ConfigError("ray.namespace must not be empty")
        if self.log_format and self.log_format not in logs.FORMATS:
            raise ConfigError(
                f"ray.log_format must be one of {', '.join(logs.FORMATS)}, got {self.log_format!r}"
            )
        for name in ("startup_timeout_s", "router_timeout_s", "monitor_interval_s"):
            if not (0 < getattr(self, name) < math.inf):  # a NaN passed "<= 0"
                raise ConfigError(f"ray.{name} must be > 0, got {getattr(self, name)}")
        if not (0 <= self.drain_timeout_s < math.inf):
            raise ConfigError(f"ray.drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.decode_pool.replicas < 1:
            raise ConfigError(
                f"a deployment needs >= 1 decode worker, got decode={self.decode_pool.replicas}"
            )
        self.router.disaggregation.check_prefill_workers(
            self.prefill_pool.replicas, "ray.prefill.replicas"
        )
        if self.autoscale.enabled:  # else the first round drains or starts the difference
            for pool in self.pools:
                policy, start = self.autoscale.policy(pool), self.pool(pool).replicas
                if not policy.min_replicas <= start <= policy.max_replicas:
                    raise ConfigError(
                        f"ray.{pool}.replicas {start} is outside the autoscaling bounds "
                        f"[{policy.min_replicas}, {policy.max_replicas}] "
                        f"(ray.autoscale.{pool}.min_replicas / max_replicas)"
                    )
        if self.engine.tensor_parallel_size != 1:
            raise ConfigError(
                "set ray.decode.tensor_parallel_size (per pool), not "
                "engine.tensor_parallel_size, in a Ray deployment"
            )

    @property
    def pools(self) -> tuple[str, ...]:
        """The pools this deployment runs: no prefill pool when decode workers prefill all."""
        return ("decode",) if self.router.disaggregation.mode == "never" else ("prefill", "decode")

    def pool(self, name: str) -> ActorResources:
        return self.prefill_pool if name == "prefill" else self.decode_pool

    def worker_config(self, pool: str, host: str) -> PrefillConfig | DecodeConfig:
        """The role config one worker of ``pool`` runs, bound to ``host`` on free ports."""
        res = self.pool(pool)
        threads = max(1, int(res.num_cpus))  # per rank
        engine = dataclasses.replace(
            self.engine,
            num_threads=self.engine.num_threads or threads,
            tensor_parallel_size=res.tensor_parallel_size,
        )
        where = {"engine": engine, "host": host, "port": 0, "cluster": self.cluster}
        role = self.prefill if pool == "prefill" else self.decode
        where.update(self._metrics(role))
        if pool == "prefill":
            return dataclasses.replace(role, **where)
        return dataclasses.replace(role, **where, kv_port=0)

    def _metrics(self, role) -> dict[str, Any]:
        if self.metrics and role.metrics_port is None:
            return {"metrics_port": 0}
        return {}

    @property
    def targets_file(self) -> str:
        """Where the controller writes the Prometheus file_sd targets (its own node)."""
        import tempfile
        from pathlib import Path

        default = Path(tempfile.gettempdir()) / f"tandem-{self.namespace}-targets.json"
        return self.metrics_targets_file or str(default)

    def router_config(self) -> RouterConfig:
        return dataclasses.replace(
            self.router,
            model=self.engine.model,
            cache_dir=self.engine.cache_dir,
            max_model_len=router_context(self.router.max_model_len, self.engine.max_model_len),
            prefill_workers=(),
            decode_workers=(),
            cluster=self.cluster,
            **self._metrics(self.router),
        )


SECTIONS = ("engine", "router", "prefill", "decode", "cluster", "ray")  # a deploy file's


def deploy_config(values: dict[str, Any], where: str = "") -> RayDeployConfig:
    """A RayDeployConfig from YAML-shaped values (see the module docstring)."""
    values = dict(values)
    unknown = sorted(set(values) - set(SECTIONS))
    if unknown:
        raise ConfigError(
            f"unknown section{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
            f"{' in ' + where if where else ''} (known: {', '.join(SECTIONS)})"
        )
    on_nodes = {"host": "each worker listens on its node's address"}
    drain = {"drain_timeout_s": "set ray.drain_timeout_s (scale-down) or `tandem ray down --grace`"}
    refuse_launcher_settings(values, where, also={"router": drain, "prefill": {**on_nodes, **drain},
                                                  "decode": {**on_nodes, **drain}})  # fmt: skip
    out: dict[str, Any] = {}
    for key, cls in (("engine", EngineConfig), ("cluster", ClusterSecurityConfig)):
        if key in values:
            out[key] = from_dict(cls, section(values, key, where), where=where)
    if "router" in values:
        out["router"] = role_config(
            RouterConfig, {"host": "0.0.0.0", **section(values, "router", where)}, where=where
        )
    for key, cls in (("prefill", PrefillConfig), ("decode", DecodeConfig)):
        if key in values:
            out[key] = role_config(cls, section(values, key, where), where=where)
    ray = dict(section(values, "ray", where))
    here = f"{where} ray".strip()
    for key, name in (("prefill", "prefill_pool"), ("decode", "decode_pool")):
        if key in ray:
            pool = {"resources": {key: 1}, **section(ray, key, here)}
            ray.pop(key)
            ray[name] = from_dict(ActorResources, pool, where=f"{where} ray.{key}")
    if "router" in ray:
        actor = {"resources": HEAD_NODE, "strategy": "DEFAULT", **section(ray, "router", here)}
        ray.pop("router")
        ray["router_actor"] = from_dict(ActorResources, actor, where=f"{where} ray.router")
    if "autoscale" in ray:
        scale = dict(section(ray, "autoscale", here))
        ray.pop("autoscale")
        defaults = AutoscaleConfig()
        for pool in ("prefill", "decode"):
            if pool in scale:
                base = dataclasses.asdict(getattr(defaults, pool))
                given = section(scale, pool, f"{where} ray.autoscale")
                scale[pool] = from_dict(PoolPolicy, {**base, **given},
                                        where=f"{where} ray.autoscale.{pool}")  # fmt: skip
        ray["autoscale"] = from_dict(AutoscaleConfig, scale, where=f"{where} ray.autoscale")
    for name in ("prefill_pool", "decode_pool", "router_actor", "autoscale"):
        if name in ray and not dataclasses.is_dataclass(ray[name]):
            raise ConfigError(f"ray.{name} is not a setting; use ray.prefill / decode / router")
    return from_dict(RayDeployConfig, {**out, **ray}, where=where)
