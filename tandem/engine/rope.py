"""Rotary position embeddings, including the scaling types HF configs can name.

The tables are computed once for every position the model may see; a step looks
positions up instead of recomputing cos/sin per layer.
"""

from __future__ import annotations

import math

import torch

from tandem.engine.model_config import ModelConfig


def inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32.

    The supported scaling types all keep the attention scaling at 1.0.
    """
    dim = cfg.head_dim
    base = cfg.rope_theta
    rope = cfg.rope_scaling
    kind = cfg.rope_type
    if kind == "dynamic":
        # Dynamic NTK with a fixed base for the longest context the scaling allows
        # (as vLLM does): HF grows the base with the longest sequence seen so far,
        # which would make a request's output depend on its batch neighbours.
        factor = rope["factor"]
        max_pos = rope.get("original_max_position_embeddings", cfg.max_position_embeddings)
        seq_len = max_pos * factor
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "linear":
        freq = freq / rope["factor"]
    elif kind == "llama3":
        freq = _llama3_inv_freq(freq, rope)
    return freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    factor = rope["factor"]
    low_freq_factor = rope["low_freq_factor"]
    high_freq_factor = rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cache(cfg: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_positions, head_dim], float32."""
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq(cfg))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The sin table with its first half negated: what ``apply_rope`` takes, so that the
    rotation is a roll and two products rather than slices, a negation and a concat."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos and ``signed_sin(sin)``: [tokens, head_dim],
    already gathered by position. HF's ``x * cos + rotate_half(x) * sin``, bit for bit."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1)
    return x * cos[:, None, :] + rotated * sin_signed[:, None, :]
