"""The architecture facts Tandem needs from a Hugging Face ``config.json``.

Llama, Qwen2 and SmolLM (which is a Llama) share one decoder; anything outside
what that decoder implements is refused here with the setting named, so that a
model we cannot run fails at load time instead of producing wrong tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] = field(
        default_factory=dict
    )  # {} or HF rope dict with "rope_type"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope_scaling type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default") if self.rope_scaling else "default"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a ``config.json`` dict (transformers 4.x or 5.x spelling); ``source``
        (the file's path) names it when a size is missing or not a positive integer."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"{source} is not a JSON object, got {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (supported: silu)")
        if cfg.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported")
        if cfg.get("pretraining_tp", 1) != 1:
            raise ConfigError(f"pretraining_tp={cfg['pretraining_tp']} is not supported (only 1)")

        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        if "type" in rope and "rope_type" not in rope:  # legacy spelling
            rope["rope_type"] = rope.pop("type")
        rope_theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        if rope.get("rope_type", "default") == "default":
            rope = {}

        _check_sizes(cfg, source)
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        qwen = model_type == "qwen2"
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            max_position_embeddings=cfg["max_position_embeddings"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=True if qwen else cfg.get("attention_bias", False),
            o_bias=False if qwen else cfg.get("attention_bias", False),
            mlp_bias=False if qwen else cfg.get("mlp_bias", False),
            eos_token_ids=eos_ids,
        )


# The sizes the decoder is built from: a missing one is a KeyError, a zero one a division
# by zero deep in the build, so each is checked here and named with the file.
_REQUIRED_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim")  # absent, null or 0: derived


def _check_sizes(cfg: dict[str, Any], source: str) -> None:
    for key in _REQUIRED_SIZES + _OPTIONAL_SIZES:
        if key not in cfg:
            if key in _REQUIRED_SIZES:
                raise ConfigError(f"{source} has no {key}")
            continue
        value = cfg[key]
        if key in _OPTIONAL_SIZES and value in (None, 0):
            continue
        if type(value) is not int or value < 1:  # bool is an int, and not a size
            raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
