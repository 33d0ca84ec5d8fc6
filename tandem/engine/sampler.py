"""Turn one step's logits into one token per request.

Order per row: repetition penalty -> greedy argmax (temperature 0), or
temperature -> top-k -> top-p -> min-p -> softmax -> draw from a generator
seeded with the row's own seed. Every batched operation here is row-wise, so a
row's probabilities, and with its own seed its draw, do not depend on which
other rows share the batch.

A request's seed is not a generator whose state advances with each token: the
seed of output token ``i`` is ``draw_seed(request seed, i)``. Token ``i`` then
depends only on the seed, ``i`` and the logits, so any worker can draw it
without being handed state (the decode side of a disaggregated request, or a
worker that continues a request moved off a failed one).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import NamedTuple

import torch

from tandem.engine.sampling_params import SamplingParams
from tandem.kernels.cpu import step_ops as cpu_ops

# Logits in float32 (or bfloat16) hold a distribution to about 1e-7, so the mass ahead
# of a token can come out a few ulps under top_p when it is exactly top_p in real
# numbers; without this slack that token would be kept or dropped by rounding alone.
# The softmax and the running sum are taken in float64: in float32 over a 49k
# vocabulary their error, with a slack to match (1e-6), picked another nucleus than
# the exact one in 5 rows of 100.
_TOP_P_SLACK = 1e-7

_MASK64 = (1 << 64) - 1
# An odd 64-bit multiplier: it spreads the position's bits over the whole word before
# the XOR, so that small seeds and small positions do not cancel (seed 1 at position 0
# and seed 0 at position 1 would otherwise draw alike). splitmix64 then mixes.
_POSITION_MULTIPLIER = 0xD1B54A32D192ED03


def new_seed(seed: int | None) -> int:
    """A request's seed: its own, or a fresh one from the OS for an unseeded request."""
    return secrets.randbits(64) if seed is None else seed


def draw_seed(seed: int, position: int) -> int:
    """The generator seed for output token ``position`` (0-based) of a request seeded ``seed``.

    Any Python int is a valid ``seed`` (it is taken modulo 2**64); the result is in
    [0, 2**64), which torch's ``manual_seed`` accepts.
    """
    return splitmix64((seed & _MASK64) ^ ((position * _POSITION_MULTIPLIER) & _MASK64))


def splitmix64(x: int) -> int:
    """The SplitMix64 output for state ``x``: a bijective, well-mixed 64-bit hash."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    """Stateless between calls; per-request state (the draw seed, the history) is passed in."""

    def __init__(self) -> None:
        # Reseeded before every draw, so it carries nothing from one row to the next.
        self._generator = torch.Generator(device="cpu")

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int | None],
        histories: list[Sequence[int]],
    ) -> list[int]:
        """Pick one token id per row of ``logits`` ([batch, vocab], any float dtype).

        ``params``, ``seeds`` and ``histories`` hold one entry per row. ``seeds`` are
        the seeds of this step's draws (``draw_seed(request seed, position)``, in
        [0, 2**64)); a ``None`` seed draws from torch's global CPU generator instead.
        Greedy rows ignore theirs. ``histories`` are prompt plus generated ids, used
        by repetition_penalty.
        """
        batch = logits.shape[0]
        if logits.dim() != 2 or not len(params) == len(seeds) == len(histories) == batch:
            raise ValueError(
                f"expected logits [batch, vocab] and one params/seed/history per row, got "
                f"logits {tuple(logits.shape)}, {len(params)} params, {len(seeds)} "
                f"seeds, {len(histories)} histories"
            )
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled or any(p.repetition_penalty != 1 for p in params):
            # A copy: the penalty and the filters below write in place.
            logits = logits.to(torch.float32, copy=True)
            _apply_repetition_penalty(logits, params, histories)
        else:
            logits = logits.float()

        tokens = [0] * batch
        if greedy:
            rows = logits if not sampled else logits[_index(greedy, logits.device)]
            # The first maximum, by C on a CPU (step_ops.argmax); else max's indices,
            # which are argmax's at a third of its time: 185 against 570 us for 16
            # rows of SmolLM2's 49,152 logits.
            ids = cpu_ops.argmax(rows)
            if ids is None:
                ids = rows.max(dim=-1).indices.tolist()
            for row, token in zip(greedy, ids, strict=True):
                tokens[row] = token
        if sampled:
            sub = logits[_index(sampled, logits.device)]
            # The generator lives on the CPU, so the draw does too: one copy per step.
            probs = _sampling_probs(sub, [params[i] for i in sampled]).cpu()
            for j, row in enumerate(sampled):
                generator = None
                if seeds[row] is not None:
                    generator = self._generator
                    generator.manual_seed(seeds[row])
                draw = torch.multinomial(probs[j], 1, generator=generator)
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

    probs = sorted_logits.double().softmax(dim=-1)
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


class TokenLogprob(NamedTuple):
    """A chosen token's log-probability and the ``top`` most likely (id, logprob), most
    likely first, under the model's distribution for that position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _top_in_token_order(lp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row, ties in token order: the first listed is the one
    greedy picks (the lowest id), and which of many tied ones are listed is fixed
    (topk's order among ties is not). Sorts only topk's picks, and the whole row only
    where more than ``k`` values tie at the k-th place (a full sort of every row made
    a step that asked for logprobs twice as slow)."""
    values, ids = lp.topk(k, dim=-1)
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    by_value = values.argsort(dim=-1, descending=True, stable=True)
    values, ids = values.gather(1, by_value), ids.gather(1, by_value)
    wide = ((lp >= values[:, -1:]).sum(dim=-1) > k).nonzero().flatten()
    if len(wide):
        tied, tied_ids = lp[wide].sort(dim=-1, descending=True, stable=True)
        values[wide], ids[wide] = tied[:, :k], tied_ids[:, :k]
    return values, ids


def token_logprobs(
    logits: torch.Tensor, rows: list[int], tokens: list[int], tops: list[int]
) -> dict[int, TokenLogprob]:
    """For each of ``rows`` of ``logits`` ([batch, vocab]): the log-softmax of the raw
    logits (before temperature, penalties and filters, as vLLM reports them by default)
    at the chosen token, and its ``tops`` best alternatives. One copy to the CPU."""
    index = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[index].to(torch.float32), dim=-1)
    chosen = lp.gather(1, torch.tensor([[tokens[r]] for r in rows], device=lp.device))
    k = max(tops)
    values, ids = _top_in_token_order(lp, k) if k else (lp[:, :0], lp[:, :0].long())
    chosen, values, ids = chosen.cpu().tolist(), values.cpu().tolist(), ids.cpu().tolist()
    return {
        r: TokenLogprob(
            tokens[r],
            chosen[j][0],
            tuple(zip(ids[j][: tops[j]], values[j][: tops[j]], strict=True)),
        )  # fmt: skip
        for j, r in enumerate(rows)
    }
