"""The colocated engine: one process that prefills and decodes with continuous batching.

A request's path: ``add_request`` validates it (before any KV block is taken)
and queues a :class:`Sequence`; every ``step`` asks the scheduler for work
(decodes, then prefill chunks under the token budget), runs the model once,
samples a token for each sequence that reached its end, detokenizes it into a
UTF-8-safe text delta, checks the stop conditions, and frees the blocks of every
sequence that ended.

The prefill and decode workers run this same engine, split in two:
- prefill side: ``add_request(..., prefill_only=True)`` stops after the first
  token and keeps the prompt's KV blocks (``RequestOutput.held_block_ids``)
  until ``release`` once they have been shipped; ``on_prefill_layer``, when set,
  hears of each layer of the step that completes such a prompt as soon as that
  layer's KV is in the cache, so shipping can overlap the layers after it (layers of
  the KV tensor: in a tensor-parallel cache, layer i of each rank);
- decode side: ``reserve`` takes blocks for prompt + max_tokens (nothing runs
  yet), the KV transfer fills them, and ``admit(request_id, first_token)`` joins
  the request to the running batch as if it had prefilled here.

A request can also continue from output it already produced elsewhere (moved off
a worker that failed mid-stream): ``output_ids`` are appended to the prompt, so
the prefill computes KV for both and samples the token after them; the
detokenizer and the stop-string matcher replay them (their text is already with
the client), and they count towards max_tokens. Sampling needs no state from the
earlier run: output token ``i`` is drawn with ``draw_seed(seed, i)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import EngineConfig
from tandem.engine import gguf_int4, k_balance, parallel
from tandem.engine.block_manager import prefix_root
from tandem.engine.checks import check_request
from tandem.engine.device import keep_step_buffers_mapped, resolve_device, resolve_dtype
from tandem.engine.kv_cache import KVAllocator, KVCache, bytes_per_block, kv_cache_dtype
from tandem.engine.loader import gguf_file, load_state_dict, read_config, resolve_model
from tandem.engine.model import LlamaModel
from tandem.engine.model_config import ModelConfig
from tandem.engine.model_runner import ModelRunner
from tandem.engine.parallel import (
    ONE_DEVICE,
    Shard,
    SharedCache,
    TensorParallel,
    check_tensor_parallel,
    rank_threads,
)
from tandem.engine.sampler import Sampler, TokenLogprob, draw_seed, new_seed, token_logprobs
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import FinishReason, Sequence, Status
from tandem.engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from tandem.errors import ConfigError, InvalidRequestError, OutOfBlocksError
from tandem.kernels import get_backend, resolve_backend
from tandem.kernels.cpu import build
from tandem.kv_transfer.base import KV_LAYOUT, Fingerprint
from tandem.kv_transfer.device_checksum import algorithm_for as checksum_algorithm_for

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]  # new this step
    text: str  # new this step; always complete UTF-8 characters
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # prefill_only requests: where the prompt's KV waits for transfer (until release()).
    held_block_ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids, when the request asks


@dataclass
class EngineStats:
    """Counters since start and the last step's size (engine thread writes; the
    worker's metrics read them)."""

    preemptions: int = 0
    generated_tokens: int = 0
    last_sequences: int = 0  # sequences in the last step
    last_tokens: int = 0  # tokens computed in it (prompt chunks and decodes)


@dataclass(eq=False)
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    stops: StopStringMatcher


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        kv_allocator: KVAllocator | None = None,
        on_rank_lost: Callable[[str], None] | None = None,
    ) -> None:
        """``kv_allocator``: where the KV cache tensor is made (see ``KVCache``).
        ``on_rank_lost(reason)``: with tensor_parallel_size > 1, runs on a watcher
        thread when another rank exits (parallel.py); steps fail from then on.
        Call ``close`` when done: it stops the other ranks."""
        self.config = config = config or EngineConfig()
        self.stats = EngineStats()
        self.tensor_parallel: TensorParallel | None = None
        self.device = resolve_device(config.device, config.tensor_parallel_size)
        threads = rank_threads(config, self.device)
        if threads:
            torch.set_num_threads(threads)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # Before the weights load: a backend that cannot run here fails at once.
        self.attention_backend = resolve_backend(
            config.attention_backend, self.device, config.cache_dir
        )

        self.model_dir, cfg = model_source(config)
        self.model_config = cfg
        self.max_model_len = max_model_len(config, cfg)
        tp = config.tensor_parallel_size
        check_tensor_parallel(cfg, tp)
        shard = Shard(0, tp)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        # Per rank: each holds the KV of its own heads (the same blocks on each).
        per_block = bytes_per_block(shard.config(cfg), config.block_size, self.kv_dtype)
        num_blocks = config.num_blocks or config.kv_cache_bytes // per_block
        if not num_blocks:  # rounding up to one block would take more than was allowed
            raise ConfigError(
                f"kv_cache_bytes {config.kv_cache_bytes} holds no KV block of {per_block} "
                f"bytes (block_size {config.block_size}, kv_cache_dtype "
                f"{config.kv_cache_dtype})"
            )
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.eos_token_ids = self.tokenizer.eos_token_ids | set(cfg.eos_token_ids)
        host_blocks = config.host_kv_cache_bytes // per_block
        if config.host_kv_cache_bytes and not host_blocks:
            raise ConfigError(
                f"host_kv_cache_bytes {config.host_kv_cache_bytes} holds no KV block of "
                f"{per_block} bytes (0 turns the host tier off)"
            )

        # With several ranks on the host, one segment holds every rank's cache, and the
        # KV cache here is all of it (parallel.SharedCache); the first layers are ours.
        cache_cfg, shared = shard.config(cfg), None
        if tp > 1 and self.device.type == "cpu" and parallel.SHARE_HOST_CACHE:
            cache_cfg = dataclasses.replace(cache_cfg, num_layers=tp * cfg.num_layers)
            shape = KVCache.shape_for(cache_cfg, num_blocks, config.block_size, self.kv_dtype)
            shared = SharedCache(shape, self.kv_dtype)
            kv_allocator = shared.allocate
        # The other ranks load their shards while this one loads its own.
        if tp > 1:
            # What this rank resolved "auto" to, so that every rank computes alike.
            resolved = dataclasses.replace(
                config,
                dtype=str(self.dtype).removeprefix("torch."),
                attention_backend=self.attention_backend,
            )
            self.tensor_parallel = TensorParallel(
                resolved, num_blocks, host_blocks, self.device, on_rank_lost, shared
            )
        try:
            self.model = load_model(config, self.model_dir, cfg, self.device, self.dtype, shard)
            if self.tensor_parallel is not None:
                self.model.all_reduce = self.tensor_parallel.connect().all_reduce
            self.kv = KVCache(
                cache_cfg,
                num_blocks,
                config.block_size,
                self.kv_dtype,
                self.device,
                config.enable_prefix_caching,
                kv_allocator,
                config.kv_window_tokens,
                config.kv_sink_tokens,
                host_blocks,
                config.max_num_batched_tokens,
            )
        except BaseException:
            self.close()
            raise
        log.info(
            "model %s: %d layers, KV cache %d blocks x %d tokens (%.0f MiB%s, %s, %s), "
            "%s attention",
            config.model,
            cfg.num_layers,
            num_blocks,
            config.block_size,
            num_blocks * per_block / 2**20,
            f" on each of {tp} ranks" if tp > 1 else "",
            str(self.kv_dtype).removeprefix("torch."),
            self.device,
            self.attention_backend,
        )
        if self.tensor_parallel is not None and shared is None:
            # Each rank has its own cache: what is done to ours outside a step is logged.
            self.kv.on_kv_op = self.tensor_parallel.kv_op
            if self.kv.host is not None:
                self.kv.host.on_copy = self.tensor_parallel.kv_op
        if host_blocks:
            mib = host_blocks * per_block / 2**20
            log.info("host KV tier: %d blocks (%.0f MiB)", host_blocks, mib)
        self.runner = ModelRunner(
            self.model, self.kv, get_backend(self.attention_backend), self.tensor_parallel
        )
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler()
        self._requests: dict[str, _Request] = {}
        self._held: dict[str, Sequence] = {}  # prefill side: KV kept for transfer
        # The request ids of the step under way, once it has its batch (else None).
        self._stepping: list[str] | None = None
        self._ids = itertools.count()
        # Prefill side: on_prefill_layer(layer, [(request_id, block_ids)]) for the
        # prefill_only prompts that complete in the current step, after each layer.
        self.on_prefill_layer: Callable[[int, list[tuple[str, list[int]]]], None] | None = None

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one device)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def kv_fingerprint(self) -> Fingerprint:
        """What a KV transfer peer must match: model identity, dtype and KV geometry."""
        cfg = self.model_config
        identity = hashlib.sha256(
            json.dumps(read_config(self.model_dir), sort_keys=True).encode()
        ).hexdigest()[:12]
        return Fingerprint(
            model=f"{self.config.model}@{identity}",
            dtype=str(self.dtype).removeprefix("torch."),
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=self.kv.block_size,
            checksum=checksum_algorithm_for(self.device),
            kv_cache_dtype=self.config.kv_cache_dtype,
            kv_scaling=k_balance.SCHEME if self.config.kv_cache_dtype == "int8" else "none",
            tensor_parallel_size=self.config.tensor_parallel_size,
            kv_layout=self._kv_layout(),
        )

    def _kv_layout(self) -> str:
        """The KV tensor's layout as transfer peers must share it. Ranks that each hold
        their own cache (on GPUs) leave only rank 0's here: never transferable."""
        tp = self.tensor_parallel
        if tp is None or tp.shared is not None:
            return KV_LAYOUT
        return f"{KV_LAYOUT}; rank 0 of {tp.size} only, not transferable"

    # ---- requests -------------------------------------------------------------------

    def validate(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams,
        output_ids: Seq[int] = (),
        prefill_only: bool = False,
    ) -> None:
        """Raise InvalidRequestError if the request can never run here. Takes no blocks.
        ``prefill_only``: a prefill worker's, which holds the prompt (and any earlier
        output) whole and no more: the decode worker's pool is what holds the rest."""
        check_request(
            prompt_ids, params, self.max_model_len, self.model_config.vocab_size, output_ids
        )
        if prefill_only:
            self._check_fits_whole(len(prompt_ids) + len(output_ids), "a prefill worker ships")
            return
        total = len(prompt_ids) + params.max_tokens
        # Under a window a prompt is computed in segments: the first from an empty
        # table, each later one after a slide; generated tokens one at a time.
        step = self.kv.window_step
        later = min(step, len(prompt_ids) - step) if len(prompt_ids) > step else 1
        blocks = self.kv.max_blocks_per_sequence(total, later, min(len(prompt_ids), step))
        if blocks > self.kv.pool.num_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt + max_tokens = {total} tokens needs {blocks} KV blocks, "
                f"the pool has {self.kv.pool.num_blocks}",
            )

    def add_request(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        prefill_only: bool = False,
        output_ids: Seq[int] = (),
        cache_salt: str = "",
    ) -> str:
        """Queue a request. ``prefill_only``: stop after the first token, keep the KV.

        ``output_ids``: tokens this request already generated (and streamed) elsewhere;
        it continues after them exactly as if it had generated them here.
        ``cache_salt``: the prefix cache's namespace; only requests with the same salt
        share cached blocks (a router gives each API key its own).
        """
        seq = self._new_sequence(
            prompt_ids, params, request_id, output_ids, cache_salt=cache_salt,
            prefill_only=prefill_only,
        )  # fmt: skip
        seq.prefill_only = prefill_only
        self.scheduler.add(seq)
        return seq.request_id

    def reserve(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams,
        request_id: str,
        output_ids: Seq[int] = (),
        cache_salt: str = "",
    ) -> list[int]:
        """Decode side: blocks for the sequence so far and the output to come, the first
        to be filled by a KV transfer.

        The output to come is ``reserve_output_tokens`` more (see ``_reserve``). Raises
        OutOfBlocksError when the blocks do not fit now (the caller answers
        RESOURCE_EXHAUSTED); the request runs only after ``admit``.
        """
        return self.reserve_for_transfer(
            prompt_ids, params, request_id, output_ids, reuse_prefix=False, cache_salt=cache_salt
        )[0]

    def reserve_for_transfer(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams,
        request_id: str,
        output_ids: Seq[int] = (),
        reuse_prefix: bool = True,
        cache_salt: str = "",
    ) -> tuple[list[int], int]:
        """``reserve``; with ``reuse_prefix``, the first full blocks that this engine's
        prefix cache holds are shared, not filled by the transfer. Returns (the
        sequence's blocks, how many of the first are already cached): the sender skips
        those."""
        seq = self._reserve(
            prompt_ids, params, request_id, output_ids, reuse_prefix, True, cache_salt
        )
        if reuse_prefix:
            self.kv.count_admission(seq, shipped=True)
        else:  # no lookup: nothing to count, now or when a preemption brings it back
            seq.admitted = True
        self._register(seq)
        self.scheduler.reserve(seq)
        return list(seq.block_table), seq.num_computed // self.kv.block_size

    def prefill_here(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams,
        request_id: str,
        output_ids: Seq[int] = (),
        cache_salt: str = "",
        prompt_whole: bool = False,
    ) -> list[int]:
        """Decode side, no KV transfer: reserve as ``reserve`` does (the prompt's cached
        prefix blocks shared, not copied) and run the request from its prefill on, in
        this engine's batch. Returns its blocks. Raises OutOfBlocksError when it does
        not fit now. ``prompt_whole``: under a KV window, compute the prompt as a
        prefill worker does, with no slide until it is done (a stream moved here whose
        prompt came from one), then ``output_ids`` one at a time as first computed."""
        seq = self._reserve(
            prompt_ids, params, request_id, output_ids, match_prefix=True, cache_salt=cache_salt,
            prompt_whole=prompt_whole,
        )  # fmt: skip
        self.kv.count_admission(seq)
        self._register(seq)
        self.scheduler.add_running(seq)
        return list(seq.block_table)

    def _reserve(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams,
        request_id: str,
        output_ids: Seq[int],
        match_prefix: bool = False,
        transfer: bool = False,
        cache_salt: str = "",
        prompt_whole: bool = False,
    ) -> Sequence:
        """A sequence with blocks for its tokens so far and ``reserve_output_tokens`` more
        (at least one, at most up to max_tokens; all of max_tokens when None), not yet
        registered. Past those it grows as any running sequence does (Scheduler)."""
        waiting = len(self.scheduler.waiting)
        if waiting:  # preempted: they run again before anything new is taken in
            raise OutOfBlocksError(f"{waiting} preempted requests wait to run again first")
        if self.scheduler.slots_taken() >= self.config.max_num_seqs:
            raise OutOfBlocksError(f"max_num_seqs ({self.config.max_num_seqs}) reached")
        ahead = self.config.reserve_output_tokens
        output = params.max_tokens
        if ahead is not None:
            output = min(output, len(output_ids) + ahead)
        total = len(prompt_ids) + output
        windowed = self.kv.window_tokens is not None
        prompt_whole = prompt_whole or transfer  # a prefill worker computed it whole
        if prompt_whole or not windowed:  # held whole before any window slides it
            whole = len(prompt_ids) + (len(output_ids) if transfer else 0) + 1  # + the next
            self._check_fits_whole(whole if windowed else total, "a decode worker reserves")
        seq = self._new_sequence(
            prompt_ids, params, request_id, output_ids, register=False, cache_salt=cache_salt
        )
        seq.prompt_whole = prompt_whole
        if match_prefix:
            self.kv.match_prefix(seq)
            if not transfer:  # a transfer fills the blocks after the cached ones: slid in admit
                self.kv.slide(seq)
        if windowed:
            # No more than the window holds at once: prompt segments computed here
            # (``window_chunk``) or the arrived KV, then one token at a time. The rest
            # the scheduler allocates as the window slides.
            arrived = len(seq.token_ids) if transfer else seq.num_computed
            chunk = 1 if transfer else self.kv.window_chunk(seq, seq.num_uncomputed)
            # What is held now (the arrived KV, or the segment to compute on what the
            # table holds) slides only once computed: then one token at a time, or the
            # next segment of a prompt longer than one. (A full window before a prompt
            # held whole overcounted, and an idle worker refused it for ever.)
            one_segment = seq.num_prompt_tokens <= self.kv.window_step
            # The next segment is what is left of the prompt, if less than a whole one.
            rest = seq.num_prompt_tokens - (arrived + chunk)
            whole = prompt_whole or one_segment or rest <= 0
            later = 1 if whole else min(rest, self.kv.window_step)
            held = self.kv.max_blocks_per_sequence(total, later) * self.kv.block_size
            evicted = seq.num_evicted_blocks * self.kv.block_size
            total = min(total, max(arrived + chunk, evicted + held))
        if not self.kv.ensure(seq, total):
            need = self.kv.blocks_for(self.kv.table_index(seq, total)) - len(seq.block_table)
            held = len(seq.block_table)  # its cached prefix, counted free once let go
            free = self.kv.pool.num_free
            self.kv.free(seq)
            cached = f" ({held} of its prefix cached)" if held else ""
            raise OutOfBlocksError(f"request needs {need} more KV blocks{cached}, {free} free")
        return seq

    def _check_fits_whole(self, num_tokens: int, holder: str) -> None:
        """Refuse, naming the limit, KV that must be held whole (before any window
        applies) but can never fit the pool. Without a window ``validate`` implies it."""
        blocks = self.kv.blocks_for(num_tokens)
        if blocks > self.kv.pool.num_blocks:
            raise InvalidRequestError(
                "prompt",
                f"{holder} the KV of {num_tokens} tokens whole: {blocks} KV blocks, the pool "
                f"has {self.kv.pool.num_blocks} (kv_window_tokens applies after admission)",
            )

    def admit(self, request_id: str, first_token: int) -> RequestOutput:
        """Decode side: the KV of every token so far (prompt and any earlier output) is
        in the reserved blocks; decode from here on.

        Returns the output for ``first_token`` (the token the prefill side sampled):
        the prefill side already streamed its text, but the token may end the
        request, and the detokenizer must see it. Seeded sampling needs no state from
        the prefill side (see sampler.py).
        """
        req = self._requests[request_id]
        seq = req.seq
        if seq.status is not Status.RESERVED:
            raise ValueError(f"request {request_id!r} is {seq.status.value}, not reserved")
        seq.num_computed = len(seq.token_ids)
        self.kv.commit(seq)  # prompt_whole: only KV that the window would compute the same
        self.kv.slide(seq)  # a KV window keeps the arrived prompt's sinks and window
        out = self._postprocess(req, first_token)
        if not out.finished:
            self.scheduler.add_running(seq)
        return out

    def release(self, request_id: str) -> bool:
        """Prefill side: the held KV has been shipped (or will never be); free its blocks."""
        seq = self._held.pop(request_id, None)
        if seq is None:
            return False
        self.kv.free(seq)
        seq.status = Status.FINISHED
        return True

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once. False if it is not known."""
        if self.release(request_id):
            return True
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        req.seq.finish_reason = FinishReason.CANCELLED
        self.scheduler.finish(req.seq)
        return True

    @property
    def held_ids(self) -> frozenset[str]:
        """Prefill side: the requests whose KV is held for a transfer."""
        return frozenset(self._held)

    @property
    def request_ids(self) -> frozenset[str]:
        """The requests not finished (decode-side reservations included), not held."""
        return frozenset(self._requests)

    def abort_scheduled(self) -> list[str]:
        """Abort every request but the KV that a transfer may still move: a prefill
        side's held KV (being read) and a decode side's reservations (being written),
        which their owners, the KV sender and receiver, end. Returns the ids."""
        ids = [rid for rid, r in self._requests.items() if r.seq.status is not Status.RESERVED]
        for request_id in ids:
            self.abort(request_id)
        return ids

    def abort_failed_step(self) -> list[str]:
        """After ``step`` raised: abort the requests it was computing, whose state is
        not to be trusted; the others (waiting, not in its batch) stay queued. A step
        that failed before it had its batch (scheduling) takes every request but the
        KV that transfers may move (``abort_scheduled``). Returns the ids."""
        stepping, self._stepping = self._stepping, None
        if stepping is None:
            return self.abort_scheduled()
        ids = [rid for rid in stepping if rid in self._requests]
        for request_id in ids:
            self.abort(request_id)
        return ids

    def abort_all(self) -> list[str]:
        """Abort every request, held KV included; returns their ids."""
        ids = [*self._requests, *self._held]
        for request_id in ids:
            self.abort(request_id)
        return ids

    def _new_sequence(
        self,
        prompt_ids: Seq[int],
        params: SamplingParams,
        request_id: str | None,
        output_ids: Seq[int] = (),
        register: bool = True,
        cache_salt: str = "",
        prefill_only: bool = False,
    ) -> Sequence:
        self.validate(prompt_ids, params, output_ids, prefill_only)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests or request_id in self._held:
            raise InvalidRequestError("request_id", f"request_id {request_id!r} is already running")
        seq = Sequence(
            request_id=request_id,
            token_ids=[*prompt_ids, *output_ids],
            num_prompt_tokens=len(prompt_ids),
            params=params,
            seed=None if params.greedy else new_seed(params.seed),
        )
        seq.cache_root = seq.last_block_hash = prefix_root(cache_salt)
        if register:
            self._register(seq)
        return seq

    def _register(self, seq: Sequence) -> None:
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        req = _Request(
            seq, IncrementalDetokenizer(self.tokenizer, prompt), StopStringMatcher(seq.params.stop)
        )
        # Earlier output goes through both as _postprocess put it through them (the
        # text is dropped: the client has it), so text held back then (a partial
        # character, a possible stop string) is held back now too.
        for token in seq.output_ids:
            req.stops.push(req.detok.add(token))
        self._requests[seq.request_id] = req

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- the step loop ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._stepping = None  # until the step has its batch: every request is at stake
        batch = self.scheduler.schedule()
        stats = self.stats
        stats.preemptions += len(batch.preempted)
        if not batch:  # no step: its figures are 0, not the last step's
            stats.last_sequences = stats.last_tokens = 0
            return []
        self._stepping = [seq.request_id for seq, _ in batch.work]
        stats.last_sequences = len(batch.work)
        stats.last_tokens = sum(n for _, n in batch.work)
        seqs, logits = self.runner.run(batch.work, self._layer_hook(batch.work))
        for seq, _ in batch.work:
            self.kv.commit(seq)
        tokens = self.sampler(
            logits,
            [s.params for s in seqs],
            [None if s.seed is None else draw_seed(s.seed, s.num_output_tokens) for s in seqs],
            [s.token_ids for s in seqs],
        )
        stats.generated_tokens += len(seqs)
        logprobs = self._logprobs(seqs, logits, tokens)
        outputs = [
            self._postprocess(self._requests[s.request_id], t, logprobs.get(i))
            for i, (s, t) in enumerate(zip(seqs, tokens, strict=True))
        ]
        self._stepping = None
        return outputs

    @staticmethod
    def _logprobs(seqs: list[Sequence], logits, tokens: list[int]) -> dict[int, TokenLogprob]:
        """Row -> the chosen token's logprob, for the rows whose requests ask for them."""
        asked = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not asked:
            return {}
        return token_logprobs(logits, asked, tokens, [seqs[i].params.logprobs for i in asked])

    def _layer_hook(self, work: list[tuple[Sequence, int]]) -> Callable[[int], None] | None:
        """``on_prefill_layer`` bound to this step's completing prefill_only prompts (not
        those whose first token is their last by max_tokens: nothing will read their KV)."""
        hook = self.on_prefill_layer
        if hook is None:  # decode workers and colocated engines: nothing per layer
            return None
        done = [
            (s.request_id, list(s.block_table))
            for s, n in work
            if s.prefill_only
            and s.num_computed + n == len(s.token_ids)
            and s.num_output_tokens + 1 < s.params.max_tokens
        ]
        if not done:
            return None
        # Layer i of every rank (a shared tensor-parallel cache: layers i, L + i, ...).
        num_layers = self.model_config.num_layers
        cached = range(0, self.kv.tensor.shape[0], num_layers)

        def ship(layer: int) -> None:
            for first in cached:
                hook(first + layer, done)

        return ship

    def _postprocess(
        self, req: _Request, token: int, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        seq = req.seq
        seq.token_ids.append(token)
        params = seq.params
        reason = None
        if (
            token in self.eos_token_ids and not params.ignore_eos
        ) or token in params.stop_token_ids:
            reason, text = FinishReason.STOP, ""
        else:
            text, stopped = req.stops.push(req.detok.add(token))
            if stopped:
                reason = FinishReason.STOP
            elif seq.num_output_tokens >= params.max_tokens:
                reason = FinishReason.LENGTH
        held = None
        if reason is not None:
            if not req.stops.stopped:
                rest, stopped = req.stops.push(req.detok.flush())
                text += rest + req.stops.flush()
                if stopped:  # the held-back text held a stop string: that ended it
                    reason = FinishReason.STOP
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            del self._requests[seq.request_id]
        elif seq.prefill_only:
            # The rest is decoded elsewhere: keep the prompt's KV until release().
            # Text held back here (a partial UTF-8 character, a possible stop string)
            # is recomputed by the decode side, whose detokenizer sees this token too.
            self.scheduler.hold(seq)
            del self._requests[seq.request_id]
            self._held[seq.request_id] = seq
            held = list(seq.block_table)
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=[token],
            text=text,
            finished=reason is not None or held is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            held_block_ids=held,
            logprobs=None if logprob is None else [logprob],
        )

    # ---- conveniences -----------------------------------------------------------------

    def stream(self, prompt_ids: Seq[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Run one request to completion, yielding its outputs as they are produced."""
        request_id = self.add_request(prompt_ids, params)
        try:
            while True:
                for out in self.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(request_id)

    def score(self, token_ids: Seq[int], chunk_tokens: int | None = None) -> list[float]:
        """The log-probability of each of ``token_ids[1:]`` given the tokens before it,
        computed as a prefill computes a prompt: chunks of ``chunk_tokens`` (default
        max_num_batched_tokens) through the paged cache, in this engine's KV dtype and
        window. For benchmarks and tests (perplexity); call it on an idle engine."""
        ids = list(token_ids)
        if len(ids) < 2:
            return []
        chunk = chunk_tokens or self.config.max_num_batched_tokens
        # One prompt token: under a window the chunks here are the caller's, each sliding
        # after it (KVCache.slide), not a served prompt's fixed segments.
        seq = Sequence("score", ids, 1, SamplingParams(max_tokens=1))
        logps: list[float] = []
        try:
            while seq.num_computed < len(ids) - 1:
                start = seq.num_computed
                n = min(chunk, len(ids) - 1 - start)
                if not self.kv.ensure(seq, start + n):
                    free = self.kv.pool.num_free
                    raise OutOfBlocksError(f"scoring needs more than the {free} free blocks")
                _, logits = self.runner.run([(seq, n)], all_logits=True)
                targets = torch.tensor(ids[start + 1 : start + n + 1], device=logits.device)
                logp = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])
                logps.extend(logp[:, 0].tolist())
        finally:
            self.kv.free(seq)
        return logps

    def generate(
        self, prompts: list[Seq[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run several requests together (one continuous batch); output token ids per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                outputs[out.request_id].extend(out.token_ids)
        return [outputs[i] for i in ids]


def model_source(config: EngineConfig) -> tuple[Path, ModelConfig]:
    """The model's Hugging Face directory (converted or built once) and its architecture."""
    model_dir = resolve_model(config.model, config.cache_dir)
    return model_dir, ModelConfig.from_hf(read_config(model_dir), str(model_dir / "config.json"))


def max_model_len(config: EngineConfig, cfg: ModelConfig) -> int:
    return min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)


def load_model(
    config: EngineConfig,
    model_dir: Path,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    shard: Shard = ONE_DEVICE,
) -> LlamaModel:
    """The weights (``shard``'s part of them) on ``device`` in ``dtype``, ready to run."""
    if device.type == "cpu":  # every CPU kernel from config.cache_dir's build (if it builds)
        build.load(config.cache_dir)
    model = LlamaModel(shard.config(cfg), max_model_len(config, cfg))
    try:
        model.load_hf_state_dict(load_state_dict(model_dir, lambda n: shard.part(n, cfg)))
    except ValueError as exc:
        raise ConfigError(f"cannot load weights from {model_dir}: {exc}") from exc
    int4 = _int4_packed(config, model, model_dir, device, dtype, shard)
    if config.kv_cache_dtype == "int8":
        k_balance.balance(model, _group_queries(model_dir, cfg, shard))
    model = model.to(device=device, dtype=dtype).eval()
    # The RoPE tables stay float32: positions near the context end need the precision.
    model.rope_cos = model.rope_cos.float()
    model.rope_sin_signed = model.rope_sin_signed.float()
    if device.type == "cpu":
        model.pack_for_cpu()
        keep_step_buffers_mapped()
    for name, forms in int4.items():
        model.get_submodule(name).use_int4(forms, config.int4_max_rows)
    return model


def _group_queries(model_dir: Path, cfg: ModelConfig, shard: Shard):
    """Per layer, the query rows (weight, bias) of the whole groups of ``shard``'s KV
    heads, where it holds only some of their query heads (more ranks than KV heads:
    each KV head is on several ranks); None where it holds them all."""
    mine = shard.config(cfg)
    group = cfg.num_heads // cfg.num_kv_heads
    if mine.num_heads == mine.num_kv_heads * group:
        return None
    kv = shard.kv_heads(cfg)
    rows = (slice(kv.start * group * cfg.head_dim, kv.stop * group * cfg.head_dim),)
    tensors = load_state_dict(
        model_dir, lambda name: (rows, False), lambda name: ".self_attn.q_proj." in name
    )
    return [
        (tensors[f"model.layers.{i}.self_attn.q_proj.weight"],
         tensors.get(f"model.layers.{i}.self_attn.q_proj.bias"))
        for i in range(cfg.num_layers)
    ]  # fmt: skip


def _int4_packed(
    config: EngineConfig,
    model: LlamaModel,
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    shard: Shard,
) -> gguf_int4.Packed:
    """The projections that small steps run from the GGUF's codes (see gguf_int4):
    none unless the model is a Q4_1 GGUF on one CPU, in bfloat16 (with torch's int4
    kernel) or float32 (with the CPU kernels' library)."""
    if (
        config.int4_max_rows == 0
        or device.type != "cpu"
        or shard.size != 1
        or not (
            (dtype == torch.bfloat16 and gguf_int4.available())
            or (dtype == torch.float32 and gguf_int4.F32_MAX_ROWS and gguf_int4.f32_available())
        )
    ):
        return {}
    gguf = gguf_file(config.model)
    return {} if gguf is None else gguf_int4.load_packed(model, gguf, model_dir, dtype)
