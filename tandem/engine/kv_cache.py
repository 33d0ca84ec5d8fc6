"""The paged KV cache: one tensor for every layer's blocks, and the pool that owns them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.engine.block_manager import BlockPool, hash_block
from tandem.engine.host_tier import HostTier
from tandem.engine.model_config import ModelConfig
from tandem.engine.sequence import Sequence
from tandem.kernels.torch_ref import row_width


def kv_cache_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for the ``kv_cache_dtype`` setting: auto is the model's."""
    return torch.int8 if setting == "int8" else model_dtype


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for ``block_size`` tokens (GQA: KV heads, not query heads)
    in a cache of ``dtype`` (int8: with each row's scale)."""
    row = row_width(cfg.head_dim, dtype) * dtype.itemsize
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * row


# (shape, dtype, device) -> a zeroed tensor
KVAllocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


class KVCache:
    # Hears ``("zero", blocks)`` for the blocks ``ensure`` zeroed (and, through the
    # host tier's on_copy, its copies): tensor-parallel ranks do the same to theirs.
    on_kv_op: Callable[[tuple], None] | None = None

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        enable_prefix_caching: bool = True,
        allocate: KVAllocator | None = None,
        window_tokens: int | None = None,
        sink_tokens: int = 0,
        host_blocks: int = 0,
        window_step_tokens: int = 0,
    ) -> None:
        """``allocate``: makes the zeroed cache tensor (default ``torch.zeros``); a KV
        transfer backend may place it where its peers can read it in place.
        ``window_tokens``, ``sink_tokens`` and ``window_step_tokens`` (the engine's step
        budget): see ``slide``. ``host_blocks``: the size of a host-memory tier behind
        the cache (host_tier.py; 0: none)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window_tokens = window_tokens
        self.sink_blocks = -(-sink_tokens // block_size)
        # A prompt under a window is computed in segments of this many tokens (whole
        # blocks) that slide only at their ends: see ``slide``.
        self.window_step = max(block_size, window_step_tokens // block_size * block_size)
        self.window_evicted_blocks = 0  # counter: blocks freed by the window
        self.pool = BlockPool(num_blocks, block_size)
        # Prefix-cache counters (for the hit-rate metric): prompt tokens looked up, found.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        # Of those, the lookups of sequences whose KV another engine sends (``shipped``).
        self.shipped_query_tokens = 0
        self.shipped_hit_tokens = 0
        # One block past the pool, never allocated and always zero, pads block tables.
        self.null_block = num_blocks
        # [layers, 2 (K, V), num_blocks + 1, block_size, kv_heads, head_dim]: a layer's
        # K (or V) for all blocks is one contiguous tensor, so the attention ops see
        # the [num_blocks, block_size, kv_heads, head_dim] view they expect. An int8
        # cache's rows are head_dim + 2 wide: the values, then their float16 scale
        # (tandem/kernels/torch_ref.py).
        shape = self.shape_for(cfg, num_blocks, block_size, dtype)
        self.tensor = (allocate or _zeros)(shape, dtype, device)
        self.host = HostTier(self.tensor, host_blocks) if host_blocks else None
        if self.host is not None:
            self.pool.on_evict = self._save_to_host

    @staticmethod
    def shape_for(
        cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> tuple[int, ...]:
        width = row_width(cfg.head_dim, dtype)
        return (cfg.num_layers, 2, num_blocks + 1, block_size, cfg.num_kv_heads, width)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table_index(self, seq: Sequence, num_tokens: int) -> int:
        """Where the first ``num_tokens`` of ``seq`` end in its block table (tokens)."""
        return num_tokens - seq.num_evicted_blocks * self.block_size

    def max_blocks_per_sequence(
        self, num_tokens: int, chunk_tokens: int, first_tokens: int = 0
    ) -> int:
        """The most blocks a sequence of ``num_tokens`` holds at once: its first
        ``first_tokens`` held whole before any slide (a first prompt segment, a prompt
        computed or arrived whole), then steps of at most ``chunk_tokens`` computed
        after a slide (bounded by the window where there is one)."""
        if self.window_tokens is None:
            return self.blocks_for(num_tokens)
        # After a slide the table holds the sinks and fewer than window + block tokens.
        kept = self.sink_blocks * self.block_size + self.window_tokens + self.block_size - 1
        return self.blocks_for(min(num_tokens, max(first_tokens, kept + chunk_tokens)))

    def slide(self, seq: Sequence) -> int:
        """With a KV window: free the oldest blocks after the sinks while the rest still
        hold ``window_tokens`` computed tokens; returns how many were freed.

        The attention that follows sees the sink blocks, then the window, as one run
        of tokens (the block table's order); their K were rotated at their original
        positions, so the gap is only missing context. A prefill-only sequence keeps
        all its KV: it is shipped whole.

        What a token sees must not depend on how its prompt was cut into chunks (that
        follows the step budget other requests leave): a prompt slides only at the
        ends of fixed segments of ``window_step`` tokens from its start, and no chunk
        crosses one (``window_chunk``), so each prompt token sees the window as it was
        at its segment's start, then its segment up to itself; each generated token is
        computed alone and sees the window as of itself.
        """
        if self.window_tokens is None or seq.prefill_only:
            return 0
        upto = seq.num_computed
        if upto < seq.num_prompt_tokens:
            if seq.prompt_whole:
                return 0
            upto -= upto % self.window_step
        bs, freed = self.block_size, 0
        while self.table_index(seq, upto) - (self.sink_blocks + 1) * bs >= self.window_tokens:
            self.pool.free([seq.block_table.pop(self.sink_blocks)])
            seq.num_evicted_blocks += 1
            freed += 1
        self.window_evicted_blocks += freed
        return freed

    def same_as_windowed(self, seq: Sequence) -> int:
        """Of ``seq``'s tokens, computed elsewhere with full attention (a KV transfer),
        how many have the KV this engine would have computed itself: all of them
        without a window; under one, the prompt segments before its first slide,
        which saw every earlier token here too. Only those may enter the prefix cache:
        past them a later request's hit would read KV computed without the window,
        and its tokens would depend on which requests came before it."""
        n = len(seq.token_ids)
        first = self.first_slide_tokens()
        return n if first is None else min(n, first, seq.num_prompt_tokens)

    def first_slide_tokens(self) -> int | None:
        """Under a window, where a prompt's first slide comes (the end of a segment):
        no KV past it enters the prefix cache. None without a window."""
        if self.window_tokens is None:
            return None
        upto = self.window_step
        while upto - (self.sink_blocks + 1) * self.block_size < self.window_tokens:
            upto += self.window_step
        return upto

    def window_chunk(self, seq: Sequence, n: int) -> int:
        """How many of ``n`` tokens ``seq`` may compute in its next step (see ``slide``):
        under a window, up to its prompt segment's end, or a generated token alone."""
        if self.window_tokens is None or seq.prefill_only:
            return n
        done = seq.num_computed
        if done >= seq.num_prompt_tokens:  # generated tokens (recomputed after preemption)
            return min(n, 1)
        if seq.prompt_whole:  # no segments: the prompt, then each generated token alone
            return min(n, seq.num_prompt_tokens - done)
        return min(n, self.window_step - done % self.window_step, seq.num_prompt_tokens - done)

    def match_prefix(self, seq: Sequence) -> None:
        """Reuse cached blocks for the longest run of full blocks already computed elsewhere.

        At least one token is left to compute, since its logits give the next token.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return
        bs = self.block_size
        parent = seq.cache_root
        try:
            for i in range((len(seq.token_ids) - 1) // bs):
                h = hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs])
                block = self.pool.lookup(h)
                if block is not None:
                    self.pool.share(block)
                elif self.host is not None and self.pool.num_free and self.host.has_prefix(h):
                    block = self._load_from_host(h)
                else:
                    break
                seq.block_table.append(block)
                parent = h
        except BaseException:  # a failed copy from the host tier: the blocks shared go back
            self.free(seq)  # (a sequence not registered yet has no other owner to free them)
            raise
        n = len(seq.block_table)
        seq.num_hashed_blocks = n
        seq.num_computed = n * bs
        seq.last_block_hash = parent

    def _save_to_host(self, block: int, block_hash: int) -> None:
        assert self.host is not None
        self.host.save_prefix(block_hash, self.tensor, block)

    def _load_from_host(self, block_hash: int) -> int:
        """A device block holding the host tier's copy of a prefix block, hashed."""
        assert self.host is not None
        host = self.host.take_prefix(block_hash)  # before allocate may spill into the tier
        block = None
        try:
            (block,) = self.pool.allocate(1)
            self.host.restore(host, self.tensor, block)
        except BaseException:  # a failed copy: nothing kept on either side (recomputed)
            if block is not None:
                self.pool.free([block])
            self.host.release([host])
            raise
        self.pool.set_hash(block, block_hash)
        return block

    def swap_out(self, seq: Sequence) -> bool:
        """Preemption by swapping: copy ``seq``'s computed blocks to the host tier and
        free them here, keeping what it computed; False (nothing changed) without a
        tier or room in it, and the caller recomputes instead.

        Swapping a block costs two copies of its bytes; recomputing it, its tokens'
        prefill: bench/host_tier.py measures both (swapping was ~500x cheaper on
        this CPU, and a GPU's compute and PCIe keep it far ahead), so the policy is
        to swap whenever the tier has room.
        """
        computed = self.blocks_for(self.table_index(seq, seq.num_computed))
        if self.host is None or not computed:  # (nothing computed: nothing to keep)
            return False
        host = self.host.swap_out(self.tensor, seq.block_table[:computed])
        if host is None:
            return False
        self.pool.free(seq.block_table[::-1])
        seq.block_table = []
        seq.host_blocks = host
        return True

    def swap_in(self, seq: Sequence, num_tokens: int) -> bool:
        """Bring a swapped sequence back with blocks for its first ``num_tokens``; False
        (nothing changed) if the pool cannot hold them now."""
        assert self.host is not None and seq.host_blocks is not None
        if self.blocks_for(self.table_index(seq, num_tokens)) > self.pool.num_free:
            return False
        blocks = self.pool.allocate(len(seq.host_blocks))
        try:
            self.host.swap_in(seq.host_blocks, self.tensor, blocks)
        except BaseException:  # the copy failed: still swapped out, the blocks free again
            self.pool.free(blocks[::-1])
            raise
        seq.block_table = list(blocks)  # not the list the copy names: the table grows
        seq.host_blocks = None
        return self.ensure(seq, num_tokens)

    def count_admission(self, seq: Sequence, shipped: bool = False) -> None:
        """Account a just-admitted sequence's prefix hit (its computed tokens so far),
        once: a preempted one admitted again finds its own freed blocks, no prefix hit.
        ``shipped``: another engine computes its prompt and sends what is not cached."""
        if seq.admitted:
            return
        seq.admitted = True
        self.prefix_query_tokens += len(seq.token_ids)
        self.prefix_hit_tokens += seq.num_computed
        if shipped:
            self.shipped_query_tokens += len(seq.token_ids)
            self.shipped_hit_tokens += seq.num_computed

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` blocks for its first ``num_tokens`` tokens; False if the pool is short."""
        need = self.blocks_for(self.table_index(seq, num_tokens)) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        blocks = self.pool.allocate(need)
        try:
            # Attention reads a block's unwritten slots (masked); a freed block's old
            # values there could be NaN/inf, and masking cannot hide those. Zero them
            # once here rather than masking on every read.
            self.tensor.index_fill_(2, torch.tensor(blocks, device=self.tensor.device), 0)
            if self.on_kv_op is not None:
                self.on_kv_op(("zero", blocks))
        except BaseException:  # no block table holds them yet: nothing else would free them
            self.pool.give_back(blocks)
            raise
        seq.block_table.extend(blocks)
        return True

    def commit(self, seq: Sequence) -> None:
        """Register hashes of blocks that became full and computed, for prefix reuse
        (not once the window freed some: table indices no longer count from 0; of a
        prompt computed whole, only what the window would have computed the same)."""
        if not self.enable_prefix_caching or seq.num_evicted_blocks:
            return
        bs = self.block_size
        done = seq.num_computed
        if seq.prompt_whole:
            done = min(done, self.same_as_windowed(seq))
        while (seq.num_hashed_blocks + 1) * bs <= done:
            i = seq.num_hashed_blocks
            h = hash_block(seq.last_block_hash, seq.token_ids[i * bs : (i + 1) * bs])
            self.pool.set_hash(seq.block_table[i], h)
            seq.last_block_hash = h
            seq.num_hashed_blocks += 1

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks; tail first, so shared prefixes are evicted last."""
        self.pool.free(seq.block_table[::-1])
        seq.block_table = []
        if seq.host_blocks is not None:
            assert self.host is not None
            self.host.release(seq.host_blocks)
            seq.host_blocks = None
        seq.num_computed = 0
        seq.num_hashed_blocks = 0
        seq.num_evicted_blocks = 0
        seq.last_block_hash = seq.cache_root
