"""Turns a scheduled batch into tensors, runs the model, and returns logits to sample.

Owns the model, the KV cache tensor and the attention backend; knows nothing of
requests beyond token ids, positions and block tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tandem.engine.kv_cache import KVCache
from tandem.engine.model import AttentionMetadata, LlamaModel, PrefillSlice
from tandem.engine.sequence import Sequence

if TYPE_CHECKING:
    from tandem.engine.parallel import TensorParallel


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        ops,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        """``tensor_parallel``: the other ranks, sent each step before it runs here."""
        self.model = model
        self.kv = kv
        self.ops = ops
        self.device = kv.tensor.device
        self.tensor_parallel = tensor_parallel

    def run(
        self,
        work: list[tuple[Sequence, int]],
        after_layer: Callable[[int], None] | None = None,
        all_logits: bool = False,
    ) -> tuple[list[Sequence], torch.Tensor]:
        """Compute the scheduled tokens (single-token work first, as the scheduler orders it).

        Returns the sequences that reached their last token and so need a new one
        sampled, with their logits [n, vocab] float32; ``all_logits``: the logits of
        every token computed instead, in work order (scoring a text). ``after_layer``:
        see ``LlamaModel.forward``. A KV window slides after the step (KVCache.slide).
        """
        bs = self.kv.block_size
        plan = StepPlan()
        sample_rows: list[int] = []
        to_sample: list[Sequence] = []
        for seq, n in work:
            start = seq.num_computed
            end = start + n
            table = seq.block_table
            plan.input_ids.extend(seq.token_ids[start:end])
            plan.positions.extend(range(start, end))  # RoPE: the original positions
            # Where the tokens lie in the block table: behind blocks a window freed,
            # the kept context is one run of tokens from index 0.
            first, last = self.kv.table_index(seq, start), self.kv.table_index(seq, end)
            plan.slots.extend(table[i // bs] * bs + i % bs for i in range(first, last))
            if n == 1:
                plan.decode_tables.append(table[: -(-last // bs)])
                plan.decode_lens.append(last)
            else:
                start_row = len(plan.input_ids) - n
                plan.prefills.append((start_row, n, last, table[: -(-last // bs)]))
            if end == len(seq.token_ids):
                sample_rows.append(len(plan.input_ids) - 1)
                to_sample.append(seq)

        input_ids, positions, meta = plan.inputs(self.device, self.kv.null_block)
        if self.tensor_parallel is not None:
            self.tensor_parallel.step(plan)
        try:
            hidden = self.model(input_ids, positions, self.kv.tensor, meta, self.ops, after_layer)
        except BaseException as exc:
            if self.tensor_parallel is not None:
                # The other ranks wait in this step's all-reduces, which the next step's
                # would pair with, out of step: the group cannot go on.
                self.tensor_parallel.fail(f"rank 0 failed inside a step ({exc!r})")
            raise
        rows = hidden if all_logits else hidden[_tensor(sample_rows, self.device)]
        logits = self.model.logits(rows)
        for seq, n in work:
            seq.num_computed += n
            self.kv.slide(seq)
        return to_sample, logits


@dataclass
class StepPlan:
    """One step's model inputs as plain lists: what tensor-parallel ranks are sent
    (parallel.py), each building the same tensors on its own device."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # where each token's K/V is stored
    # Single-token decodes come first in the batch: their block tables and lengths.
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    # Prefill chunks: (start in the batch, query_len, context_len, block table).
    prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)

    def inputs(
        self, device: torch.device, null_block: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, attention metadata) on ``device``; ``null_block`` pads."""
        num_decode = len(self.decode_lens)
        meta = AttentionMetadata(
            slot_mapping=_tensor(self.slots, device),
            num_decode=num_decode,
            decode_block_tables=_padded(self.decode_tables, null_block, device)
            if num_decode
            else None,
            decode_context_lens=_tensor(self.decode_lens, device) if num_decode else None,
            decode_max_len=max(self.decode_lens, default=0),
            prefills=[
                PrefillSlice(start, query_len, context_len, _tensor(table, device))
                for start, query_len, context_len, table in self.prefills
            ],
        )
        return _tensor(self.input_ids, device), _tensor(self.positions, device), meta


def _tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _padded(tables: list[list[int]], null_block: int, device: torch.device) -> torch.Tensor:
    # Padding points at the always-zero null block; attention masks it anyway.
    width = max(len(t) for t in tables)
    padded = [t + [null_block] * (width - len(t)) for t in tables]
    return _tensor(padded, device).view(len(tables), width)
