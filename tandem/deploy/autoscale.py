"""The autoscaling policy: how many prefill and decode workers the load asks for.

A pure decision over numbers, so it is tested without Ray; the Ray controller
(``tandem/deploy/ray_cluster/loops.py``) feeds it each worker's ``Status``
every ``interval_s`` and applies what it returns.

Per pool, the load is one number per serving worker:
- prefill: queue depth (requests waiting to be scheduled);
- decode: KV utilisation, used blocks / total blocks in [0, 1] (the decode worker
  reserves a request's prompt and ``reserve_output_tokens`` more when it accepts it,
  and grows it from there).

The wanted size is ``ceil(replicas * mean / target)`` (the rule of Kubernetes'
horizontal pod autoscaler), kept at the current size while the mean is within
``tolerance`` of the target, and clamped to ``[min_replicas, max_replicas]``.
Scale-up may jump several workers at once; scale-down removes one worker per
decision, because each removal drains in-flight requests. After a pool's size
changes, it does not grow again for ``scale_up_cooldown_s`` nor shrink for
``scale_down_cooldown_s``, so that a new worker's effect shows in the numbers
before the next decision. A pool shrinks only when every size asked for over the
last ``scale_down_window_s`` was smaller (Kubernetes' stabilization window): one
low sample of a noisy queue must not drain a worker that the next sample wants
back, and nothing shrinks in the first window after the autoscaler starts. Bounds
win over cooldowns: a pool outside its bounds is brought inside at once.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.errors import ConfigError

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class PoolPolicy:
    """One pool's bounds and target load per worker."""

    min_replicas: int = 1
    max_replicas: int = 4
    target: float = 1.0  # prefill: queue depth per worker; decode: KV utilisation in (0, 1]

    def check(self, pool: str) -> None:
        if self.min_replicas < 1:
            raise ConfigError(
                f"autoscale.{pool}.min_replicas must be >= 1, got {self.min_replicas}"
            )
        if self.max_replicas < self.min_replicas:
            raise ConfigError(
                f"autoscale.{pool}.max_replicas must be >= min_replicas ({self.min_replicas}), "
                f"got {self.max_replicas}"
            )
        if not self.target > 0:
            raise ConfigError(f"autoscale.{pool}.target must be > 0, got {self.target}")


@dataclass(frozen=True)
class AutoscaleConfig:
    enabled: bool = False
    interval_s: float = 5.0  # how often the controller decides
    prefill: PoolPolicy = field(default_factory=lambda: PoolPolicy(target=2.0))
    decode: PoolPolicy = field(default_factory=lambda: PoolPolicy(target=0.7))
    tolerance: float = 0.1  # no change while |mean / target - 1| <= tolerance
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 120.0
    scale_down_window_s: float = 60.0  # shrink only if every size asked for in it was smaller

    def __post_init__(self) -> None:
        # Written as "not (ok)": a NaN fails every comparison, and slipped through
        # "x <= 0" (asyncio.sleep(nan) never returns; a NaN cooldown never cools).
        if not (0 < self.interval_s < math.inf):
            raise ConfigError(f"autoscale.interval_s must be > 0, got {self.interval_s}")
        if not 0 <= self.tolerance < 1:
            raise ConfigError(f"autoscale.tolerance must be in [0, 1), got {self.tolerance}")
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s", "scale_down_window_s"):
            value = getattr(self, name)
            if not (0 <= value < math.inf):
                raise ConfigError(f"autoscale.{name} must be >= 0, got {value}")
        self.prefill.check("prefill")
        self.decode.check("decode")
        if self.decode.target > 1:
            raise ConfigError(
                f"autoscale.decode.target is a KV utilisation in (0, 1], got {self.decode.target}"
            )

    def policy(self, pool: str) -> PoolPolicy:
        return self.prefill if pool == "prefill" else self.decode


def wanted_replicas(
    replicas: int, loads: Sequence[float], policy: PoolPolicy, tolerance: float
) -> int:
    """The size the load asks for, within bounds; no cooldown here.

    ``loads``: one number per serving worker (may be fewer than ``replicas`` while
    some start; then the mean over those that answered stands for the pool).
    """
    lo, hi = policy.min_replicas, policy.max_replicas
    if not loads or replicas < 1:
        return min(max(replicas, lo), hi)
    ratio = (sum(loads) / len(loads)) / policy.target
    if abs(ratio - 1) <= tolerance:
        wanted = replicas
    else:
        wanted = math.ceil(replicas * ratio - 1e-9)
    return min(max(wanted, lo), hi)


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    wanted: int  # what the load asks for (bounded)
    replicas: int  # what to run now (after cooldown and the one-at-a-time scale-down)
    reason: str


class Autoscaler:
    """Remembers when each pool last changed size; ``decide`` returns the next sizes."""

    def __init__(self, config: AutoscaleConfig, pools: Sequence[str] = POOLS) -> None:
        """``pools``: those to size (a colocated deployment has no prefill pool)."""
        self.config = config
        self.pools = tuple(pools)
        self._last_change: dict[str, float] = {}
        # By pool: (time, size asked for) over the last scale_down_window_s, and when
        # the first was asked.
        self._asked: dict[str, collections.deque[tuple[float, int]]] = {}
        self._first: dict[str, float] = {}

    def resized(self, pool: str, now: float) -> None:
        """Record a size change made elsewhere (a manual scale): cooldowns start from it."""
        self._last_change[pool] = now

    def decide(
        self,
        now: float,
        replicas: dict[str, int],
        loads: dict[str, Sequence[float]],
        pools: Sequence[str] | None = None,
    ) -> dict[str, Decision]:
        """The next size of each of ``pools`` (default: all it sizes)."""
        return {
            pool: self._decide(pool, now, replicas[pool], loads.get(pool, ()))
            for pool in (self.pools if pools is None else pools)
        }

    def _decide(self, pool: str, now: float, current: int, loads: Sequence[float]) -> Decision:
        cfg = self.config
        policy = cfg.policy(pool)
        wanted = wanted_replicas(current, loads, policy, cfg.tolerance)
        mean = f"mean load {sum(loads) / len(loads):.2f}" if loads else "no load reported"
        since = now - self._last_change.get(pool, -math.inf)
        asked = self._asked.setdefault(pool, collections.deque())
        asked.append((now, wanted))
        while asked[0][0] < now - cfg.scale_down_window_s:
            asked.popleft()
        window = now - self._first.setdefault(pool, now)
        if current < policy.min_replicas or current > policy.max_replicas:
            target, why = wanted, f"outside [{policy.min_replicas}, {policy.max_replicas}]"
        elif wanted > current and since < cfg.scale_up_cooldown_s:
            target, why = current, f"{mean}; scale-up cooling down ({since:.0f} s)"
        elif wanted < current and since < cfg.scale_down_cooldown_s:
            target, why = current, f"{mean}; scale-down cooling down ({since:.0f} s)"
        elif wanted < current and (
            window < cfg.scale_down_window_s or max(n for _, n in asked) >= current
        ):
            target, why = current, (f"{mean}; not under target for scale_down_window_s "
                                    f"({cfg.scale_down_window_s:g} s) yet")  # fmt: skip
        elif wanted < current:
            target, why = current - 1, f"{mean} under target {policy.target:g}"
        elif wanted > current:
            target, why = wanted, f"{mean} over target {policy.target:g}"
        else:
            target, why = current, f"{mean} near target {policy.target:g}"
        if target != current:
            self._last_change[pool] = now
        return Decision(pool, current, wanted, target, why)
