"""Placement: which worker of a pool gets the next request.

A policy sees one ``WorkerLoad`` per placeable worker (healthy, in registration
order) and returns one of them. The loads are the last polled ``Status`` numbers
corrected by what the router itself has sent since that poll (see
``registry.Worker.load``), so that a burst of requests between two polls spreads
out instead of piling onto the worker that looked emptiest.

- ``least-loaded``: decode: the workers whose free KV blocks are within a tenth
  of the most any has, then the shortest queue, then the fewest running (a
  difference of a few blocks, such as a prefix cache holds, must not send every
  request to one worker); prefill: the shortest queue, then the fewest running.
  Remaining ties go to the fewest requests in flight from this router, then take
  turns: idle workers share a trickle of requests instead of the first registered
  one taking them all.
- ``round-robin``: each pool in turn, ignoring the numbers.
- ``prefix-aware``: the worker likely to hold the longest prefix of the prompt in
  its prefix cache, within a load bound; else ``least-loaded`` (see PrefixAware).
"""

from __future__ import annotations

import abc
import collections
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.engine.block_manager import hash_block, prefix_root
from tandem.errors import ConfigError


class Pool(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


# Tokens per KV block of a worker that has not said (engine.block_size's default).
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class WorkerLoad:
    address: str
    queue_depth: int = 0  # waiting to be scheduled on the worker
    running: int = 0  # in the worker's batch
    kv_blocks_free: int = 0
    inflight: int = 0  # this router's requests on the worker now
    kv_blocks_total: int = 0
    kv_block_size: int = DEFAULT_BLOCK_SIZE  # tokens per block, of KV and prefix cache
    kv_window_tokens: int = 0  # its engine's KV window (0: none)
    prefix_cache_max_tokens: int = 0  # the most of a prompt its prefix cache keeps (0: all)
    # What each prompt token adds to its steps lately (tandem/worker/step_cost.py; 0
    # until it has prefilled).
    prefill_token_seconds: float = 0.0
    # Decode: this router's requests it is to prefill itself, whose first token is not
    # back (the conditional rule adds them to what a local prefill would stall).
    prefilling: int = 0
    prefilling_tokens: int = 0


# Decode workers with at least this fraction of the most free KV blocks count as equal.
KV_BAND = 0.9


class PlacementPolicy(abc.ABC):
    name: str
    # Of the last pick's token_ids, how many the chosen worker is expected to have in
    # its prefix cache (0 for policies that do not track it); valid until the next pick.
    cached_tokens: int = 0
    # What the last pick noted on its worker ahead of the worker's answer, for
    # ``refused`` (None for policies that note nothing); valid until the next pick.
    noted: object = None

    @abc.abstractmethod
    def pick(
        self,
        pool: Pool,
        candidates: Sequence[WorkerLoad],
        token_ids: Sequence[int] = (),
        cache_salt: str = "",
    ) -> WorkerLoad:
        """One of ``candidates`` (never empty, in registration order) for a request whose
        tokens so far (prompt, and output of a migrated request) are ``token_ids``, in
        the workers' prefix-cache namespace ``cache_salt``."""

    def holds(
        self, pool: Pool, address: str, token_ids: Sequence[int], cache_salt: str = ""
    ) -> None:
        """The worker at ``address`` took a request whose tokens are ``token_ids`` (a
        prompt it prefills or reserved KV for; at the request's end, prompt and every
        output token): what it holds now, for policies that track it."""
        return None

    def refused(self, noted: object) -> None:
        """The worker of the pick that ``noted`` (``self.noted`` after it) turned the
        request away at its door: it holds nothing of it."""
        return None

    def forget(self, pool: Pool, address: str) -> None:
        """The worker at ``address`` went down, restarted or was removed: whatever it
        held is gone."""
        return None


class LeastLoaded(PlacementPolicy):
    name = "least-loaded"

    def __init__(self) -> None:
        self._turn = {pool: 0 for pool in Pool}

    def pick(
        self,
        pool: Pool,
        candidates: Sequence[WorkerLoad],
        token_ids: Sequence[int] = (),
        cache_salt: str = "",
    ) -> WorkerLoad:
        if pool is Pool.DECODE:
            most = max(w.kv_blocks_free for w in candidates)
            keys = [
                (w.kv_blocks_free < KV_BAND * most, w.queue_depth, w.running, w.inflight)
                for w in candidates
            ]
        else:
            keys = [(w.queue_depth, w.running, w.inflight) for w in candidates]
        best = min(keys)
        tied = [w for w, k in zip(candidates, keys, strict=True) if k == best]
        turn = self._turn[pool]
        self._turn[pool] = turn + 1
        return tied[turn % len(tied)]


class RoundRobin(PlacementPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = {pool: 0 for pool in Pool}

    def pick(
        self,
        pool: Pool,
        candidates: Sequence[WorkerLoad],
        token_ids: Sequence[int] = (),
        cache_salt: str = "",
    ) -> WorkerLoad:
        # A counter modulo the current size: membership changes shift the turn,
        # but every placeable worker still gets one request in each len() in a row.
        i = self._next[pool] % len(candidates)
        self._next[pool] = i + 1
        return candidates[i]


# A worker whose KV pool size is not known yet (no Status answered): remember this many.
_UNKNOWN_POOL_BLOCKS = 4096


class PrefixAware(PlacementPolicy):
    """The worker that most likely holds the longest prefix of the prompt in its prefix
    cache, if that prefix is at least ``min_match`` of the prompt's full blocks and
    the worker is not busier than the least loaded one by more than
    ``imbalance_max`` requests (waiting + running); otherwise ``least-loaded``. The
    ratio keeps prompts that share only their first block or two (a chat template's
    header) from all following the first worker that saw one (SGLang's
    cache_threshold, 0.5 there too).

    What a worker holds is estimated from this router's own placements, as SGLang's
    cache-aware router does, rather than from the workers' reports of blocks cached and
    evicted: it needs no protocol, costs one hash per block of prompt tokens, and is
    right exactly when it matters (a prefix placed recently is still cached). A pick
    notes the prompt on its worker at once, so that a burst of prompts with one prefix
    follows the first before its prefill is done; a worker that refuses at its door
    holds nothing of it, and what its pick noted is taken back (``refused``), while a
    worker that takes a request has it noted again (``holds``: a concurrent refusal of
    the same prompt may have taken it back). A decode worker also caches the tokens it
    generated, and the router streamed them: a finished request's whole sequence joins
    its worker's history, so that a conversation's next turn, which repeats the reply,
    follows it there. A worker's history is an LRU of chained block hashes (those of the
    engines' prefix cache: ``hash_block`` over blocks of the worker's ``kv_block_size``,
    which its Status reports) bounded by the worker's own KV pool size, so that what the
    worker must have evicted is forgotten too. Blocks shared with another router's
    requests are not seen; a worker that evicted early is found out at its next
    placement (the hit is lower, nothing breaks). A worker taken down, removed, found
    restarted (its counters since start went back) or with another block size is
    forgotten (``forget``), so that no decision counts on a cache that is gone.
    """

    name = "prefix-aware"

    def __init__(self, imbalance_max: int = 8, min_match: float = 0.5):
        self.imbalance_max = imbalance_max
        self.min_match = min_match
        self._fallback = LeastLoaded()
        # pool -> worker address -> block hashes, least recently placed first
        self._history: dict[Pool, dict[str, collections.OrderedDict[int, None]]] = {
            pool: {} for pool in Pool
        }
        # worker address -> (KV blocks it holds, tokens per block, prefix_cache_max_tokens),
        # as of its last placement
        self._pool_size: dict[str, tuple[int, int, int]] = {}

    def pick(
        self,
        pool: Pool,
        candidates: Sequence[WorkerLoad],
        token_ids: Sequence[int] = (),
        cache_salt: str = "",
    ) -> WorkerLoad:
        # Each worker's blocks in its own block size (one size in any usual deployment),
        # as many as its prefix cache keeps of a prompt.
        hashes = {
            (w.kv_block_size, w.prefix_cache_max_tokens): self._hashes(
                token_ids, cache_salt, w.kv_block_size, w.prefix_cache_max_tokens
            )
            for w in candidates
        }
        mine = {w.address: hashes[w.kv_block_size, w.prefix_cache_max_tokens] for w in candidates}
        history = self._history[pool]
        matched = {w.address: self._matched(history.get(w.address), mine[w.address])
                   for w in candidates}  # fmt: skip
        # A decode worker without room for the blocks the prompt adds to what it holds
        # would refuse the reservation, however much of the prompt it holds (unless
        # every worker is as short: least-loaded's band).
        eligible = candidates
        if pool is Pool.DECODE:
            most = max(w.kv_blocks_free for w in candidates)
            eligible = [
                w
                for w in candidates
                if w.kv_blocks_free >= KV_BAND * most
                or w.kv_blocks_free
                > (len(token_ids) - 1) // w.kv_block_size + 1 - matched[w.address]
            ]
        held = {w.address: matched[w.address] * w.kv_block_size for w in candidates}  # tokens
        best = max((held[w.address] for w in eligible), default=0)
        choice = None
        if best:
            load = {w.address: w.queue_depth + w.running for w in candidates}
            least = min(load.values())
            holders = [w for w in eligible if held[w.address] == best]
            holder = min(holders, key=lambda w: (load[w.address], w.inflight))
            full = len(mine[holder.address])
            if (
                matched[holder.address] >= self.min_match * full
                and load[holder.address] - least <= self.imbalance_max
            ):
                choice = holder
        if choice is None:
            choice = self._fallback.pick(pool, candidates)
        self.cached_tokens = held[choice.address]
        self._pool_size[choice.address] = (
            choice.kv_blocks_total or _UNKNOWN_POOL_BLOCKS,
            choice.kv_block_size,
            choice.prefix_cache_max_tokens,
        )
        known = history.get(choice.address) or {}
        self.noted = (pool, choice.address, [h for h in mine[choice.address] if h not in known])
        self._remember(pool, choice.address, mine[choice.address])
        return choice

    def holds(
        self, pool: Pool, address: str, token_ids: Sequence[int], cache_salt: str = ""
    ) -> None:
        if address in self._pool_size:
            _, block_size, most = self._pool_size[address]
            self._remember(pool, address, self._hashes(token_ids, cache_salt, block_size, most))

    def refused(self, noted: object) -> None:
        if noted is None:
            return
        pool, address, new = noted
        held = self._history[pool].get(address)
        for h in new if held is not None else ():
            held.pop(h, None)

    def forget(self, pool: Pool, address: str) -> None:
        self._history[pool].pop(address, None)
        if not any(address in history for history in self._history.values()):
            self._pool_size.pop(address, None)

    @staticmethod
    def _hashes(
        token_ids: Sequence[int], cache_salt: str = "", bs: int = DEFAULT_BLOCK_SIZE, most: int = 0
    ) -> list[int]:
        """Chained hashes of the full blocks of ``bs`` tokens a worker could reuse (not
        the last token's; at most ``most`` tokens' where that is not 0), as the
        workers' prefix caches compute them."""
        parent, out = prefix_root(cache_salt), []
        n = len(token_ids) - 1 if not most else min(len(token_ids) - 1, most)
        for i in range(n // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            out.append(parent)
        return out

    @staticmethod
    def _matched(held: collections.OrderedDict[int, None] | None, hashes: list[int]) -> int:
        if not held:
            return 0
        n = 0
        for h in hashes:  # chained: the first miss ends the prefix
            if h not in held:
                break
            n += 1
        return n

    def _remember(self, pool: Pool, address: str, hashes: list[int]) -> None:
        held = self._history[pool].setdefault(address, collections.OrderedDict())
        # Tail first, so that a sequence's first block is its most recently used: the
        # worker evicts a freed sequence's last blocks first (KvCache.free), and a
        # prefix whose first block is gone matches nothing.
        for h in reversed(hashes):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self._pool_size[address][0]:
            held.popitem(last=False)


_POLICIES: dict[str, type[PlacementPolicy]] = {
    p.name: p for p in (LeastLoaded, RoundRobin, PrefixAware)
}


def make_policy(name: str, imbalance_max: int = 8) -> PlacementPolicy:
    """``imbalance_max``: prefix-aware's load bound (RouterConfig.prefix_imbalance_max)."""
    if name not in _POLICIES:
        raise ConfigError(f"placement must be one of {', '.join(_POLICIES)}, got {name!r}")
    return PrefixAware(imbalance_max) if name == PrefixAware.name else _POLICIES[name]()
