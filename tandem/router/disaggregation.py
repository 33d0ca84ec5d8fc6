"""Conditional disaggregation: whether a request's prompt is prefilled on the prefill
pool (its KV shipped to the decode worker) or on the decode worker itself.

Shipping a prompt's KV pays when its prefill is long enough to stall the decode
worker's running streams for longer than the transfer and the extra hop cost; a
short prompt, or one the prefill pool would only queue, is cheaper where it will
be decoded. The rule (``conditional``; thresholds in ``DisaggregationConfig``):

1. no live prefill worker: here (the decode pool serves on its own);
2. the tokens the decode worker would compute (prompt + already generated tokens,
   less the prefix that prefix-aware placement expects it to have cached) <=
   ``local_max_tokens``: here ("short"), unless it would stall the worker's
   streams too long (below): then on the prefill pool ("decode busy");
3. every live prefill worker has >= ``prefill_queue_max`` requests waiting, the
   decode worker runs <= ``local_max_running`` streams (counting the prompts this
   router sent it to prefill whose first token is not back) and the stall is not
   too long: here ("prefill busy");
4. otherwise on the prefill pool ("long").

Whatever the mode, a request moved off a lost worker onto a decode worker with a
KV window (``kv_window_tokens`` in its Status; the relay asks a worker added since the
last poll for its Status first) is prefilled there ("moved under a kv window"). The
lost worker computed its generated tokens one at a time, each over the window as it
was; a prefill worker would compute them in one prefill with full attention (other
KV, so other tokens), and must hold them whole, which a stream that ran past the pool
cannot be. The decode worker recomputes them as they
were first computed, one per step: exact, at a step per streamed token. Its prompt
is computed as it first was: whole (``prompt_whole``) when the prefill pool computed
it, else in the window's segments.

Too long a stall: the decode worker has streams (running, or this router's in
flight), and the time the prefill adds to the step they all wait out (the tokens
at the worker's recent cost per prompt token, ``prefill_token_seconds`` in its
Status) exceeds ``local_max_stall_ms``. The tokens are the prompt's and those of
the prompts this router sent the worker to prefill whose first token is not back:
sent within a poll, a burst is computed in one step, which the streams wait out
whole. So a prompt is short by its cost where it
would run, not by its length alone: on a GPU a 128-token prefill adds
milliseconds, on one CPU thread it can add half a second to every stream's next
token. What the step costs without the prefill is not weighed: the streams wait
that out wherever the prompt goes. A worker that has not prefilled yet reports no
per-token cost and counts as stalling nothing; its first prefill teaches it.

The router decides after it has picked the decode worker, from the loads of the
last Status poll (see placement.py), and counts each decision by its reason
(``counts``; the decode workers' Status counts ``prefilled_here`` too). With
placement ``least-loaded`` the router knows nothing of the decode worker's prefix
cache, so a long prompt it has cached still goes to the prefill pool; with
``prefix-aware`` (a chat whose history the worker holds) it stays there.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.config import DisaggregationConfig
from tandem.router.placement import WorkerLoad


@dataclass(frozen=True)
class Decision:
    here: bool  # prefill on the decode worker
    reason: str


ALWAYS = Decision(False, "always")
COLOCATED = Decision(True, "colocated")
NO_PREFILL_WORKER = Decision(True, "no prefill worker")
SHORT = Decision(True, "short")
PREFILL_BUSY = Decision(True, "prefill busy")
DECODE_BUSY = Decision(False, "decode busy")
LONG = Decision(False, "long")
MOVED_UNDER_WINDOW = Decision(True, "moved under a kv window")
_ALL = (ALWAYS, COLOCATED, NO_PREFILL_WORKER, SHORT, PREFILL_BUSY, DECODE_BUSY, LONG,
        MOVED_UNDER_WINDOW)  # fmt: skip
_HERE = {d.reason: d.here for d in _ALL}


class PrefillRouting:
    def __init__(self, config: DisaggregationConfig) -> None:
        self.config = config
        self.counts: collections.Counter[str] = collections.Counter()  # by reason

    @property
    def needs_prefill_pool(self) -> bool:
        """Whether a request cannot be served without a live prefill worker."""
        return self.config.mode == "always"

    @staticmethod
    def prefills_here(reason: str) -> bool:
        """Whether a decision counted under ``reason`` prefilled on the decode worker."""
        return _HERE[reason]

    def describe(self) -> str:
        """The decisions so far, for a log line: where, and why how often."""
        parts = []
        for here, where in ((True, "on the decode worker"), (False, "on the prefill pool")):
            mine = [(r, n) for r, n in self.counts.most_common() if _HERE[r] is here]
            if mine:
                parts.append(f"{where}: " + ", ".join(f"{n} {r}" for r, n in mine))
        return "; ".join(parts) or "none"

    def count(self, decision: Decision) -> None:
        """``decision`` was taken for a request (its reservation made): once per
        attempt, not per decode worker tried."""
        self.counts[decision.reason] += 1

    def decide(
        self, tokens: int, prefill: Sequence[WorkerLoad], decode: WorkerLoad, moved: bool = False
    ) -> Decision:
        """``tokens``: to prefill on the decode worker (see rule 2); ``prefill``: the
        live prefill workers' loads; ``decode``: the chosen decode worker's; ``moved``:
        the request carries tokens a lost worker generated (see "moved" above)."""
        c = self.config
        if moved and decode.kv_window_tokens:
            return MOVED_UNDER_WINDOW
        if c.mode == "always":
            return ALWAYS
        if c.mode == "never":
            return COLOCATED
        if not prefill:
            return NO_PREFILL_WORKER
        fits = self._stall_fits(tokens, decode)
        if tokens <= c.local_max_tokens:
            return SHORT if fits else DECODE_BUSY
        busy = min(w.queue_depth for w in prefill) >= c.prefill_queue_max
        if busy and decode.running + decode.prefilling <= c.local_max_running and fits:
            return PREFILL_BUSY
        return LONG

    def _stall_fits(self, tokens: int, decode: WorkerLoad) -> bool:
        """Whether prefilling ``tokens`` on ``decode`` stalls its streams by at most
        ``local_max_stall_ms`` (see "too long a stall" above), with the prompts sent
        there to prefill whose first token is not back: a burst is computed together."""
        limit_ms = self.config.local_max_stall_ms
        if not limit_ms or not (decode.running or decode.inflight):
            return True
        tokens += decode.prefilling_tokens
        return tokens * decode.prefill_token_seconds * 1000 <= limit_ms
