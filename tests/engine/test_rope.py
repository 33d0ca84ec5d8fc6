"""RoPE tables against transformers' own implementation."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tandem.engine.model_config import ModelConfig
from tandem.engine.rope import apply_rope, inv_freq, rope_cache, signed_sin

HEADS = 4

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# name -> (rope_scaling, rope_theta, head_dim, max_position_embeddings)
CASES: dict[str, tuple[dict[str, Any], float, int, int]] = {
    "default": ({}, 100000.0, 64, 8192),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 10000.0, 64, 8192),
    "llama3": (LLAMA3, 500000.0, 128, 131072),
}


def _ours(rope_scaling: dict[str, Any], theta: float, head_dim: int, max_pos: int) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=128,
        hidden_size=HEADS * head_dim,
        intermediate_size=64,
        num_layers=1,
        num_heads=HEADS,
        num_kv_heads=HEADS,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        rope_theta=theta,
        rope_scaling=dict(rope_scaling),
    )


def _hf(rope_scaling: dict[str, Any], theta: float, head_dim: int, max_pos: int) -> LlamaConfig:
    rope_parameters = {"rope_type": "default", **rope_scaling, "rope_theta": theta}
    return LlamaConfig(
        hidden_size=HEADS * head_dim,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=rope_parameters,
    )


def _hf_inv_freq(hf: LlamaConfig, seq_len: int | None = None) -> torch.Tensor:
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        freq, attention_scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", seq_len=seq_len)
    assert attention_scaling == 1.0  # what inv_freq assumes for every supported type
    return freq


# --- inv_freq ---


@pytest.mark.parametrize("case", CASES)
def test_inv_freq_matches_transformers(case: str) -> None:
    ours = inv_freq(_ours(*CASES[case]))

    assert ours.dtype == torch.float32
    assert ours.shape == (CASES[case][2] // 2,)
    torch.testing.assert_close(ours, _hf_inv_freq(_hf(*CASES[case])), rtol=1e-6, atol=0)


def test_llama3_case_covers_all_three_frequency_bands() -> None:
    # Otherwise the comparison above would not test the interpolated band.
    scaling, theta, head_dim, max_pos = CASES["llama3"]
    ratio = inv_freq(_ours(scaling, theta, head_dim, max_pos)) / inv_freq(
        _ours({}, theta, head_dim, max_pos)
    )
    kept = torch.isclose(ratio, torch.tensor(1.0))
    slowed = torch.isclose(ratio, torch.tensor(1 / 8))
    assert kept.sum() >= 1
    assert slowed.sum() >= 1
    assert (~kept & ~slowed).sum() >= 1


def test_linear_divides_every_default_frequency_by_the_factor() -> None:
    scaling, theta, head_dim, max_pos = CASES["linear"]
    default = inv_freq(_ours({}, theta, head_dim, max_pos))

    assert torch.equal(inv_freq(_ours(scaling, theta, head_dim, max_pos)), default / 4.0)


DYNAMIC = {"rope_type": "dynamic", "factor": 4.0}


def test_dynamic_uses_transformers_base_at_the_longest_scaled_length() -> None:
    # A fixed base: HF's dynamic NTK formula evaluated once at max_position * factor.
    ours = inv_freq(_ours(DYNAMIC, 10000.0, 64, 2048))
    hf = _hf_inv_freq(_hf(DYNAMIC, 10000.0, 64, 2048), seq_len=2048 * 4)

    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, inv_freq(_ours({}, 10000.0, 64, 2048)))


@pytest.mark.parametrize("original", [None, 1024])
def test_dynamic_base_by_hand(original: int | None) -> None:
    # At seq_len = original * factor the base grows by (factor**2 - factor + 1)**(d / (d - 2)),
    # whichever length counts as the original one.
    scaling = (
        {**DYNAMIC} if original is None else {**DYNAMIC, "original_max_position_embeddings": 1024}
    )
    ours = inv_freq(_ours(scaling, 10000.0, 64, 4096))

    base = 10000.0 * (4.0**2 - 4.0 + 1) ** (64 / 62)
    expected = [base ** -(i / 64) for i in range(0, 64, 2)]
    torch.testing.assert_close(
        ours.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0
    )


# --- rope_cache ---


@pytest.mark.parametrize("case", CASES)
def test_rope_cache_rows_are_cos_and_sin_of_position_times_inv_freq(case: str) -> None:
    cfg = _ours(*CASES[case])
    freq = inv_freq(cfg)
    cos, sin = rope_cache(cfg, 4096)

    assert cos.shape == sin.shape == (4096, cfg.head_dim)
    assert cos.dtype == sin.dtype == torch.float32
    for p in (0, 1, 37, 4095):
        angles = torch.tensor(float(p)) * freq
        torch.testing.assert_close(
            cos[p], torch.cat((angles.cos(), angles.cos())), rtol=0, atol=1e-6
        )
        torch.testing.assert_close(
            sin[p], torch.cat((angles.sin(), angles.sin())), rtol=0, atol=1e-6
        )


@pytest.mark.parametrize("case", CASES)
def test_rope_cache_matches_transformers_rotary_embedding(case: str) -> None:
    cos, sin = rope_cache(_ours(*CASES[case]), 4096)
    positions = torch.tensor([[0, 5, 811, 4095]])
    x = torch.zeros(1, positions.shape[1], CASES[case][2])  # only its dtype and device are used

    hf_cos, hf_sin = LlamaRotaryEmbedding(_hf(*CASES[case]))(x, positions)

    torch.testing.assert_close(cos[positions], hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[positions], hf_sin, rtol=0, atol=1e-6)


# --- apply_rope ---


@pytest.mark.parametrize("case", CASES)
def test_apply_rope_matches_transformers(case: str) -> None:
    cfg = _ours(*CASES[case])
    cos_table, sin_table = rope_cache(cfg, 4096)
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(1, 4096, (7,), generator=g)
    x = torch.randn(7, 3, cfg.head_dim, generator=g)  # [tokens, heads, head_dim]
    cos, sin = cos_table[positions], sin_table[positions]

    ours = apply_rope(x, cos, signed_sin(sin))

    # HF's layout: q [batch, heads, tokens, head_dim], cos/sin [batch, tokens, head_dim].
    q = x.transpose(0, 1)[None]
    hf, _ = apply_rotary_pos_emb(q, q, cos[None], sin[None], unsqueeze_dim=1)
    assert torch.equal(ours, hf[0].transpose(0, 1))  # the same products, the same sums
    assert not torch.allclose(ours, x, atol=1e-3)


def test_apply_rope_at_position_zero_is_identity() -> None:
    cfg = _ours(*CASES["default"])
    cos_table, sin_table = rope_cache(cfg, 8)
    x = torch.randn(2, 3, cfg.head_dim, generator=torch.Generator().manual_seed(1))
    zero = torch.zeros(2, dtype=torch.int64)

    assert torch.equal(apply_rope(x, cos_table[zero], signed_sin(sin_table[zero])), x)


def test_apply_rope_rotates_each_pair_by_its_angle() -> None:
    # Pair i is (x[i], x[i + d/2]); at position p it turns by p * inv_freq[i].
    cfg = _ours(*CASES["default"])
    cos_table, sin_table = rope_cache(cfg, 16)
    x = torch.randn(1, 1, cfg.head_dim, generator=torch.Generator().manual_seed(2))
    p = torch.tensor([9])

    out = apply_rope(x, cos_table[p], signed_sin(sin_table[p]))[0, 0].double()

    half = cfg.head_dim // 2
    angle = 9 * inv_freq(cfg).double()
    a, b = x[0, 0, :half].double(), x[0, 0, half:].double()
    expected = torch.cat((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    assert math.isclose(out.norm().item(), x.double().norm().item(), rel_tol=1e-6)
