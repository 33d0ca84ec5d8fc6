"""Turn one step's logits into one token per request.

Order per row: repetition penalty -> greedy argmax (temperature 0), or
temperature -> top-k -> top-p -> min-p -> softmax -> draw with the row's own
generator. Every batched operation here is row-wise, so a row's probabilities,
and with its own generator its draw, do not depend on which other rows share the
batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from tandem.engine.sampling_params import SamplingParams

# Float32 softmax and cumsum round, so the mass ahead of a token can come out a few
# ulps under top_p when it is exactly top_p in real numbers; without this slack that
# token would be kept or dropped by rounding alone.
_TOP_P_SLACK = 1e-6

_SEED_MASK = (1 << 64) - 1


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request; ``None`` draws a fresh seed from the OS."""
    if seed is None:
        seed = secrets.randbits(64)
    generator = torch.Generator(device="cpu")
    # torch accepts only [-2**63, 2**64); masking maps every Python int into it and
    # agrees with torch's own wrap-around for the negative seeds it does accept.
    generator.manual_seed(seed & _SEED_MASK)
    return generator


class Sampler:
    """Stateless; per-request state (the generator, the history) is passed in."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: list[Sequence[int]],
    ) -> list[int]:
        """Pick one token id per row of ``logits`` ([batch, vocab], any float dtype).

        ``params``, ``generators`` and ``histories`` hold one entry per row;
        ``histories`` are prompt plus generated ids, used by repetition_penalty. A
        ``None`` generator draws from torch's global CPU generator. Greedy rows never
        touch their generator.
        """
        batch = logits.shape[0]
        if logits.dim() != 2 or not len(params) == len(generators) == len(histories) == batch:
            raise ValueError(
                f"expected logits [batch, vocab] and one params/generator/history per row, got "
                f"logits {tuple(logits.shape)}, {len(params)} params, {len(generators)} "
                f"generators, {len(histories)} histories"
            )
        # Always a copy: the penalty and filters below write in place.
        logits = logits.to(torch.float32, copy=True)
        _apply_repetition_penalty(logits, params, histories)

        tokens = [0] * batch
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            ids = logits[_index(greedy, logits.device)].argmax(dim=-1).tolist()
            for row, token in zip(greedy, ids, strict=True):
                tokens[row] = token
        if sampled:
            sub = logits[_index(sampled, logits.device)]
            # The generators live on the CPU, so the draw does too: one copy per step.
            probs = _sampling_probs(sub, [params[i] for i in sampled]).cpu()
            for j, row in enumerate(sampled):
                draw = torch.multinomial(probs[j], 1, generator=generators[row])
                tokens[row] = int(draw.item())
        return tokens


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _apply_repetition_penalty(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[Sequence[int]]
) -> None:
    """In place, as Hugging Face's RepetitionPenaltyLogitsProcessor: every token id seen
    in the history gets ``logit / p`` if positive, else ``logit * p``.

    logits: [batch, vocab] float32. Ids >= vocab are ignored, as Hugging Face does.
    """
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1 and len(histories[i])]
    if not rows:
        return
    vocab = logits.shape[1]
    # One extra column absorbs out-of-vocab ids so a single index_put marks every row.
    seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool)
    row_ids = torch.repeat_interleave(
        torch.arange(len(rows)), torch.tensor([len(histories[i]) for i in rows])
    )
    token_ids = torch.tensor([t for i in rows for t in histories[i]], dtype=torch.long)
    seen[row_ids, token_ids.clamp(max=vocab)] = True
    seen = seen[:, :vocab].to(logits.device)

    index = _index(rows, logits.device)
    sub = logits[index]
    penalty = _column([params[i].repetition_penalty for i in rows], logits.device)
    penalised = torch.where(sub < 0, sub * penalty, sub / penalty)
    logits[index] = torch.where(seen, penalised, sub)


def _sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, then softmax; excluded tokens get exactly 0.

    logits: [n, vocab] float32, modified in place; params: one non-greedy entry per row.
    Each filter runs only on the rows that enable it, so rows that need none (the
    common case) cost one division and one softmax.
    """
    device = logits.device
    logits /= _column([p.temperature for p in params], device)

    vocab = logits.shape[1]
    cut = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1]
    if cut:
        index = _index(cut, device)
        chosen = [params[i] for i in cut]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in chosen]
        # An unreachable threshold turns top-p off for rows that only want top-k.
        top_p = [p.top_p if p.top_p < 1 else 2.0 for p in chosen]
        logits[index] = _top_k_top_p(
            logits[index], _column(top_k, device, torch.long), _column(top_p, device)
        )

    floor = [i for i, p in enumerate(params) if p.min_p > 0]
    if floor:
        index = _index(floor, device)
        sub = logits[index]
        probs = sub.softmax(dim=-1)
        # Tokens cut above already have probability 0; the top token always survives.
        min_p = _column([params[i].min_p for i in floor], device)
        too_rare = probs < min_p * probs.amax(dim=-1, keepdim=True)
        logits[index] = sub.masked_fill(too_rare, -torch.inf)

    return logits.softmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [n, vocab] float32; top_k: [n, 1] long (vocab = off); top_p: [n, 1] (> 1 = off).

    Works in sorted order, so ties at the k-th place keep exactly k tokens.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(logits.shape[1], device=logits.device)
    sorted_logits.masked_fill_(rank >= top_k, -torch.inf)

    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Drop a token once the tokens ahead of it already reach top_p: what is left is the
    # smallest prefix whose mass is >= top_p.
    drop = mass_before >= top_p - _TOP_P_SLACK
    drop[:, 0] = False
    sorted_logits.masked_fill_(drop, -torch.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _column(
    values: list[float] | list[int], device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[n, 1], to broadcast one value per row over the vocab."""
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)
