"""A request inside the engine: tokens, how many are computed, and its KV blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    # Disaggregation: a decode-side request whose blocks wait for the prompt's KV,
    RESERVED = "reserved"
    # and a prefill-side request whose first token is out and whose KV awaits transfer.
    HELD = "held"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(eq=False)
class Sequence:
    """``token_ids`` is prompt + output; tokens ``[0, num_computed)`` have KV in the cache.

    Chunked prefill, a prefix-cache hit, KV that arrived from a prefill worker and
    recompute after preemption are all the same thing here: a value of
    ``num_computed`` smaller than ``len(token_ids)``.

    A request continued from earlier output (moved off a failed worker) starts with
    that output already in ``token_ids``: only ``num_prompt_tokens`` tells prompt
    from output, and the model and the cache treat both alike.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    # Sampled requests only (None: greedy). Output token i is drawn with
    # draw_seed(seed, i), so a sampled stream needs no generator state carried along.
    seed: int | None = None
    status: Status = Status.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading full blocks whose hash is registered
    # Blocks freed by the KV window (after the sink blocks): the token at position p
    # lies at index p - num_evicted_blocks * block_size of the block table, for every
    # p past the evicted ones (KVCache.slide).
    num_evicted_blocks: int = 0
    # Preempted and swapped out: its computed blocks, in table order, in the host tier
    # (KVCache.swap_out); num_computed is kept.
    host_blocks: list[int] | None = None
    # Where its chain of block hashes starts (block_manager.prefix_root: the request's
    # cache salt) and the hash of its last hashed block.
    cache_root: int | None = None
    last_block_hash: int | None = None
    finish_reason: FinishReason | None = None
    prefill_only: bool = False  # stop after the first token and keep the KV (HELD)
    # Under a KV window: its prompt's KV is full attention, as a prefill worker computes
    # it (it arrived so, or a stream whose prompt did so moved here), and is computed so
    # again (after a preemption): no slide until the prompt is done.
    prompt_whole: bool = False
    admitted: bool = False  # scheduled once (its prefix lookup counted; a recompute is not)
    turn: int = 0  # the scheduler step it last ran in (who goes first when not all fit)
    # Its place in the scheduler's order of arrival (-1: not seen yet): the running
    # sequences are kept in it, and the newest is preempted first.
    arrival: int = -1

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
