"""Factory helpers shared by the engine unit tests."""

from __future__ import annotations

import torch

from tandem.engine.kv_cache import KVCache
from tandem.engine.model_config import ModelConfig


def tiny_config() -> ModelConfig:
    # GQA (2 query heads, 1 KV head), so a size computed from query heads is caught.
    return ModelConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=8,
        intermediate_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )


def make_kv(num_blocks: int = 8, block_size: int = 4, prefix_caching: bool = True) -> KVCache:
    return KVCache(
        tiny_config(),
        num_blocks,
        block_size,
        torch.float32,
        torch.device("cpu"),
        enable_prefix_caching=prefix_caching,
    )
