"""Turns a scheduled batch into tensors, runs the model, and returns logits to sample.

Owns the model, the KV cache tensor and the attention backend; knows nothing of
requests beyond token ids, positions and block tables.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.engine.kv_cache import KVCache
from tandem.engine.model import AttentionMetadata, LlamaModel, PrefillSlice
from tandem.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, ops) -> None:
        self.model = model
        self.kv = kv
        self.ops = ops
        self.device = kv.tensor.device

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
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        to_sample: list[Sequence] = []
        num_decode = 0
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSlice] = []
        for seq, n in work:
            start = seq.num_computed
            end = start + n
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))  # RoPE: the original positions
            # Where the tokens lie in the block table: behind blocks a window freed,
            # the kept context is one run of tokens from index 0.
            first, last = self.kv.table_index(seq, start), self.kv.table_index(seq, end)
            slots.extend(table[i // bs] * bs + i % bs for i in range(first, last))
            if n == 1:
                num_decode += 1
                decode_tables.append(table[: -(-last // bs)])
                decode_lens.append(last)
            else:
                prefills.append(
                    PrefillSlice(
                        start=len(input_ids) - n,
                        query_len=n,
                        context_len=last,
                        block_table=torch.tensor(table[: -(-last // bs)], device=self.device),
                    )
                )
            if end == len(seq.token_ids):
                sample_rows.append(len(input_ids) - 1)
                to_sample.append(seq)

        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode=num_decode,
            decode_block_tables=self._padded(decode_tables) if num_decode else None,
            decode_context_lens=self._tensor(decode_lens) if num_decode else None,
            decode_max_len=max(decode_lens, default=0),
            prefills=prefills,
        )
        hidden = self.model(
            self._tensor(input_ids),
            self._tensor(positions),
            self.kv.tensor,
            meta,
            self.ops,
            after_layer,
        )
        logits = self.model.logits(hidden if all_logits else hidden[self._tensor(sample_rows)])
        for seq, n in work:
            seq.num_computed += n
            self.kv.slide(seq)
        return to_sample, logits

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _padded(self, tables: list[list[int]]) -> torch.Tensor:
        # Padding points at the always-zero null block; attention masks it anyway.
        width = max(len(t) for t in tables)
        null = [self.kv.null_block]
        return self._tensor([t + null * (width - len(t)) for t in tables]).view(len(tables), width)
