"""K's per-channel factors for an int8 KV cache (tandem/engine/k_balance.py): what
they are, that they leave every score as it was, and that they cut int8's error on
the default model against the same cache without them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tandem.engine import k_balance
from tandem.engine.model import Attention
from tandem.engine.rope import rope_cache
from tandem.kv_transfer.base import Fingerprint
from tests.conftest import make_engine
from tests.engine.factories import tiny_config


def _factors(seed: int = 0, heads: int = 6, kv_heads: int = 2, head_dim: int = 16):
    g = torch.Generator().manual_seed(seed)
    hidden = 32
    wq = torch.randn(heads * head_dim, hidden, generator=g)
    wk = torch.randn(kv_heads * head_dim, hidden, generator=g)
    wk[3] *= 40  # an outlier channel of K, as trained models have
    cfg = tiny_config()
    cos, sin = rope_cache(type(cfg)(**{**cfg.__dict__, "head_dim": head_dim}), k_balance.POSITIONS)
    norm = torch.rand(hidden, generator=g) + 0.5
    return k_balance.channel_factors(wq, wk, norm, cos, sin, kv_heads)


def test_factors_are_powers_of_two_centred_per_head_and_shrink_an_outlier_channel() -> None:
    f = _factors()
    assert f.shape == (2, 16) and f.dtype == torch.float32
    log2 = f.log2()
    assert torch.equal(log2, log2.round())  # exact in any float dtype
    assert log2.abs().max() <= 4
    assert log2.mean(-1).abs().max() <= 0.5  # centred before rounding
    # K's large channel is stored smaller, where a row's one scale spent its range on it.
    assert f[0, 3] < f[0].median()


def test_balanced_queries_and_keys_give_bit_identical_attention_for_any_group() -> None:
    cfg = tiny_config()
    cfg = type(cfg)(**{**cfg.__dict__, "num_heads": 6, "num_kv_heads": 2, "head_dim": 16,
                       "hidden_size": 96})  # fmt: skip
    attn = Attention(cfg)
    g = torch.Generator().manual_seed(1)
    factors = torch.exp2(torch.randint(-4, 5, (2, 16), generator=g).float())
    attn.set_k_balance(factors)
    q = torch.randn(1, 6, 9, 16, generator=g)
    k = torch.randn(1, 2, 9, 16, generator=g)
    v = torch.randn(1, 2, 9, 16, generator=g)
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    balanced = F.scaled_dot_product_attention(
        q * attn.q_balance[None, :, None], k * attn.k_balance[None, :, None], v,
        is_causal=True, enable_gqa=True,
    )  # fmt: skip
    # A query head divides by its own group's factors: any other pairing changes scores.
    assert torch.equal(plain, balanced)


def test_only_an_int8_cache_is_balanced_and_the_handshake_names_it() -> None:
    plain, int8 = make_engine("tiny-random"), make_engine("tiny-random", kv_cache_dtype="int8")
    assert all(layer.self_attn.k_balance is None for layer in plain.model.layers)
    assert all(layer.self_attn.k_balance is not None for layer in int8.model.layers)
    assert plain.kv_fingerprint().kv_scaling == "none"
    mine = int8.kv_fingerprint()
    assert mine.kv_scaling == k_balance.SCHEME
    # A peer that predates the field stored its int8 K rows unscaled: refused by name.
    older = Fingerprint.from_dict({k: v for k, v in mine.to_dict().items() if k != "kv_scaling"})
    assert mine.mismatches(older) == f"kv_scaling: prefill {k_balance.SCHEME}, decode none"


@pytest.mark.slow
def test_the_factors_cut_int8s_error_on_the_default_model() -> None:
    """Teacher-forced log-probabilities of a text through the int8 cache, with and
    without the factors, against the float cache's: the mean absolute difference.
    Chunks of 8, so that most of what attention reads is stored rows (a chunk's own
    tokens are attended as computed)."""
    text = (
        "The river runs past the old mill, where the miller kept his accounts in a book "
        "bound in red leather. Each spring the water rose, and each autumn he wrote down "
        "what the flood had cost him. def total(costs):\n    return sum(costs)\n"
        "In 1887 the mill burned; the book survived, and it is kept in the town library."
    ) * 3
    engines = {
        name: make_engine("smollm2-135m-instruct", **settings)
        for name, settings in (("float", {}), ("int8", {"kv_cache_dtype": "int8"}),
                               ("plain", {"kv_cache_dtype": "int8"}))
    }  # fmt: skip
    for layer in engines["plain"].model.layers:
        layer.self_attn.k_balance = layer.self_attn.q_balance = None
    ids = engines["float"].tokenizer.encode(text)
    logps = {name: torch.tensor(e.score(ids, chunk_tokens=8)) for name, e in engines.items()}
    error = {n: (logps[n] - logps["float"]).abs().mean().item() for n in ("int8", "plain")}
    assert all(math.isfinite(e) and e > 0 for e in error.values()), error
    # 0.0041 against 0.0067 here (0.61); factors upside down give 0.0072 (checked).
    assert error["int8"] < error["plain"], error
