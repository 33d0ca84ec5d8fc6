"""Each supported architecture variant loads from a Hugging Face directory and matches HF.

Small models are built with transformers' own classes (so the checkpoint layout and
the reference forward are HF's, not ours), given peaked random weights, saved, and
loaded back by Tandem.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tiny_random import build_tokenizer
from tests.conftest import make_engine
from tests.parity import assert_parity, hf_greedy

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "qwen2-qkv-bias": (Qwen2ForCausalLM, Qwen2Config, {"tie_word_embeddings": False}),
    "qwen2-tied": (Qwen2ForCausalLM, Qwen2Config, {"tie_word_embeddings": True}),
    "llama-attention-bias": (
        LlamaForCausalLM,
        LlamaConfig,
        {"attention_bias": True, "mlp_bias": True},
    ),
    "llama-rope-linear": (
        LlamaForCausalLM,
        LlamaConfig,
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    ),
    "llama-rope-llama3": (LlamaForCausalLM, LlamaConfig, {"rope_parameters": LLAMA3}),
    "llama-tied-head-dim": (
        LlamaForCausalLM,
        LlamaConfig,
        {"tie_word_embeddings": True, "head_dim": 24},
    ),
}


def _peaked_random_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                gain = 8.0 if "lm_head" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * gain / p.shape[-1] ** 0.5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_hf_generate(tmp_path, variant):
    model_cls, config_cls, extra = VARIANTS[variant]
    tok = build_tokenizer()
    config = config_cls(vocab_size=len(tok), **{**COMMON, **extra})
    hf = model_cls(config).eval()
    _peaked_random_(hf, seed=len(variant))
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)

    engine = make_engine(str(tmp_path))
    # Past 64 positions, so llama3 scaling's interpolated bands matter.
    prompts = [tok.encode(t) for t in ("hello world", "你好，世界 " * 8, "rope " * 30)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0))
    for prompt, ours in zip(prompts, outs, strict=True):
        assert_parity(hf, prompt, ours, hf_greedy(hf, prompt, 20, engine.eos_token_ids))
    assert engine.kv.pool.num_used == 0
