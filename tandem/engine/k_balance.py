"""Per-channel factors that move K's int8 error to where queries do not look.

An int8 cache row has one scale (tandem/kernels/torch_ref.py), so its rounding error
is spread evenly over the rotated channels, and a score q.k picks up q.(error): the
channels where queries are large carry the error into the softmax. Most of the
greedy divergence from a float cache on the default model comes from K, not V
(bench/README.md, "int8 KV cache").

The scores are unchanged if each channel c of K is multiplied by s_c and the same
channel of every query of its group divided by s_c. Stored rows then hold s * k,
whose rounding error (proportional to the row's norm) is divided by s on the way
back into the score. For a row norm |s k| and a query q / s the expected squared
score error is proportional to sum(s_c^2 K_c) * sum(Q_c / s_c^2), with K_c and Q_c
the mean squares of channel c of k and q, which is least for s_c = (Q_c / K_c)^(1/4).

Q_c and K_c come from the weights, not from data, so that every worker of a model
computes the same factors from the same bytes, with no calibration text to agree
on. The input to the projections is RMS-normalised (mean square 1), so a channel's
mean square is taken as the squared norm of its weight row times the norm's weight,
plus its bias squared. RoPE then mixes each channel with its partner by
position-dependent angles, so that mean is taken over the rotations of the first
``POSITIONS`` positions. The factors are rounded to powers of two: multiplying by
them is exact in any float dtype, so the attention of a float cache is not changed
by a bit, and a rounding difference between two machines cannot change a factor.
"""

from __future__ import annotations

import torch

# The positions whose RoPE rotations the channels' mean squares are averaged over;
# 256 did as well as calibrating on real text, 64 to 1,024 within noise (the one-off
# measurement behind bench/README.md).
POSITIONS = 256

# What the KV handshake names (kv_transfer.base.Fingerprint.kv_scaling): peers whose
# int8 caches are scaled differently must refuse each other.
SCHEME = "k-balanced-v1"


def channel_factors(
    wq: torch.Tensor,  # [num_heads * head_dim, hidden]
    wk: torch.Tensor,  # [num_kv_heads * head_dim, hidden]
    norm_weight: torch.Tensor,  # [hidden], the input RMSNorm's
    rope_cos: torch.Tensor,  # [positions, head_dim]
    rope_sin: torch.Tensor,  # [positions, head_dim], sin (or signed sin: squared here)
    num_kv_heads: int,
    bq: torch.Tensor | None = None,
    bk: torch.Tensor | None = None,
) -> torch.Tensor:
    """Powers of two [num_kv_heads, head_dim] to multiply K by (and queries divide by)."""
    head_dim = rope_cos.shape[-1]
    g = norm_weight.double()

    def mean_squares(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        ms = (w.double() * g).square().sum(-1)
        if b is not None:
            ms = ms + b.double().square()
        ms = ms.view(-1, head_dim)
        # After RoPE, channel c is k_c cos - k_partner sin: its partner is half a head away.
        cos2 = rope_cos[:POSITIONS].double().square().mean(0)
        sin2 = rope_sin[:POSITIONS].double().square().mean(0)
        return ms * cos2 + ms.roll(head_dim // 2, dims=-1) * sin2

    k2 = mean_squares(wk, bk)
    q2 = mean_squares(wq, bq).view(num_kv_heads, -1, head_dim).mean(1)  # per group
    tiny = torch.finfo(torch.float64).tiny
    log2 = 0.25 * (q2.clamp(min=tiny).log2() - k2.clamp(min=tiny).log2())
    # Centred per head (the scale follows the row's norm, so only ratios matter), then
    # rounded, and bounded to 16x either way: a float16 q or k is multiplied by up to
    # that, so the bound keeps it far from overflow (the default model spans 2^-1..2^2).
    log2 = (log2 - log2.mean(-1, keepdim=True)).round().clamp(-4, 4)
    return torch.exp2(log2).float()


def balance(model, group_queries: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None):
    """Give each attention layer of ``model`` (a LlamaModel with its weights loaded,
    before packing) its factors: what an int8 KV cache stores (``Attention.forward``).

    ``group_queries``: per layer, the query rows (weight, bias) of every head in the
    groups of ``model``'s KV heads, where the model holds fewer (a tensor-parallel rank
    whose KV heads are replicated across ranks). A group's factors come from all its
    queries, so that every width computes the same ones: a cache written at one width
    is read at another (a KV transfer), which the handshake does not tell apart."""
    cfg = model.cfg
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        w = attn.qkv_proj.weight.detach()
        b = attn.qkv_proj.bias
        b = None if b is None else b.detach()
        wq, bq = w[:q_size], None if b is None else b[:q_size]
        if group_queries is not None:
            wq, bq = group_queries[i]
        factors = channel_factors(
            wq,
            w[q_size : q_size + kv_size],
            layer.input_layernorm.weight.detach(),
            model.rope_cos,
            model.rope_sin_signed,
            cfg.num_kv_heads,
            bq,
            None if b is None else b[q_size : q_size + kv_size],
        )
        attn.set_k_balance(factors)
