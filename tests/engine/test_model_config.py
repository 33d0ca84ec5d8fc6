"""ModelConfig.from_hf on real config.json shapes, and the settings it refuses."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
from transformers import LlamaConfig, Qwen2Config

from tandem.engine.model_config import ModelConfig
from tandem.errors import ConfigError

# HuggingFaceTB/SmolLM2-135M, as transformers 5 writes it (rope_theta inside rope_parameters).
SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 100000, "rope_type": "default"},
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
    "transformers_version": "5.0.0",
    "use_cache": True,
    "vocab_size": 49152,
}

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# meta-llama/Llama-3.1-8B-Instruct, as transformers 4 writes it (no head_dim key).
LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": dict(LLAMA3_SCALING),
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

# Qwen/Qwen2.5-0.5B-Instruct (transformers 4 spelling).
QWEN25_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(base)
    cfg.update(changes)
    return cfg


# --- real config.json shapes ---


def test_smollm2_135m_transformers5_spelling() -> None:
    assert ModelConfig.from_hf(SMOLLM2_135M) == ModelConfig(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-05,
        rope_theta=100000.0,
        rope_scaling={},
        tie_word_embeddings=True,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        eos_token_ids=(0,),
    )


def test_llama_31_8b_transformers4_spelling() -> None:
    cfg = ModelConfig.from_hf(LLAMA_31_8B)

    assert cfg == ModelConfig(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,  # hidden_size // num_attention_heads
        max_position_embeddings=131072,
        rms_norm_eps=1e-05,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_SCALING,
        tie_word_embeddings=False,
        eos_token_ids=(128001, 128008, 128009),
    )
    assert cfg.rope_type == "llama3"


def test_rope_theta_type_is_float_whatever_the_json_holds() -> None:
    assert type(ModelConfig.from_hf(SMOLLM2_135M).rope_theta) is float  # 100000 in the JSON


def test_legacy_type_spelling_of_rope_scaling() -> None:
    hf = _with(LLAMA_31_8B, rope_scaling={"type": "linear", "factor": 2.0})

    cfg = ModelConfig.from_hf(hf)

    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.rope_type == "linear"
    assert cfg.rope_theta == 500000.0
    assert hf["rope_scaling"] == {"type": "linear", "factor": 2.0}  # the caller's dict is intact


def test_transformers5_rope_parameters_keep_the_callers_dict_intact() -> None:
    hf = _with(SMOLLM2_135M, rope_parameters={**LLAMA3_SCALING, "rope_theta": 500000.0})

    cfg = ModelConfig.from_hf(hf)

    assert cfg.rope_scaling == LLAMA3_SCALING
    assert cfg.rope_theta == 500000.0
    assert hf["rope_parameters"] == {**LLAMA3_SCALING, "rope_theta": 500000.0}


def test_no_rope_settings_default_to_theta_10000() -> None:
    hf = _with(LLAMA_31_8B, rope_scaling=None)
    del hf["rope_theta"]

    cfg = ModelConfig.from_hf(hf)

    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_type) == (10000.0, {}, "default")


def test_attention_and_mlp_bias_of_a_llama() -> None:
    cfg = ModelConfig.from_hf(_with(SMOLLM2_135M, attention_bias=True, mlp_bias=True))

    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (True, True, True)


def test_qwen2_has_qkv_bias_only() -> None:
    assert ModelConfig.from_hf(QWEN25_05B) == ModelConfig(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=32768,
        rms_norm_eps=1e-06,
        rope_theta=1000000.0,
        rope_scaling={},
        tie_word_embeddings=True,
        qkv_bias=True,
        o_bias=False,
        mlp_bias=False,
        eos_token_ids=(151645,),
    )


# --- dicts transformers itself writes ---

SMALL = {
    "vocab_size": 1000,
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
}


def test_transformers_llama_config_dict_with_llama3_scaling() -> None:
    hf = LlamaConfig(
        **SMALL, rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING), tie_word_embeddings=True
    ).to_dict()

    assert ModelConfig.from_hf(hf) == ModelConfig(
        model_type="llama",
        vocab_size=1000,
        hidden_size=192,
        intermediate_size=512,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_SCALING,
        tie_word_embeddings=True,
        eos_token_ids=(2,),
    )


def test_transformers_llama_config_dict_with_legacy_linear_scaling() -> None:
    hf = LlamaConfig(**SMALL, rope_scaling={"type": "linear", "factor": 2.0}).to_dict()

    cfg = ModelConfig.from_hf(hf)

    assert cfg.rope_type == "linear"
    assert cfg.rope_scaling["factor"] == 2.0
    assert cfg.rope_theta == 10000.0


def test_transformers_qwen2_config_dict() -> None:
    hf = Qwen2Config(**SMALL, rope_theta=1000000.0).to_dict()

    assert ModelConfig.from_hf(hf) == ModelConfig(
        model_type="qwen2",
        vocab_size=1000,
        hidden_size=192,
        intermediate_size=512,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        rope_scaling={},
        tie_word_embeddings=False,
        qkv_bias=True,
        o_bias=False,
        mlp_bias=False,
        eos_token_ids=(),
    )


# --- refused settings ---


@pytest.mark.parametrize(
    ("hf", "message"),
    [
        pytest.param(
            _with(SMOLLM2_135M, model_type="mistral"),
            "model_type 'mistral' is not supported (supported: llama, qwen2)",
            id="model_type",
        ),
        pytest.param(
            {k: v for k, v in SMOLLM2_135M.items() if k != "model_type"},
            "model_type None is not supported (supported: llama, qwen2)",
            id="model_type-missing",
        ),
        pytest.param(
            _with(LLAMA_31_8B, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            "rope_scaling type 'yarn' is not supported "
            "(supported: default, linear, dynamic, llama3)",
            id="yarn-transformers4",
        ),
        pytest.param(
            _with(SMOLLM2_135M, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
            "rope_scaling type 'yarn' is not supported "
            "(supported: default, linear, dynamic, llama3)",
            id="yarn-transformers5",
        ),
        pytest.param(
            _with(LLAMA_31_8B, rope_scaling={"type": "yarn", "factor": 4.0}),
            "rope_scaling type 'yarn' is not supported "
            "(supported: default, linear, dynamic, llama3)",
            id="yarn-legacy-spelling",
        ),
        pytest.param(
            _with(SMOLLM2_135M, hidden_act="gelu"),
            "hidden_act 'gelu' is not supported (supported: silu)",
            id="hidden_act",
        ),
        pytest.param(
            _with(QWEN25_05B, use_sliding_window=True),
            "use_sliding_window=true is not supported",
            id="use_sliding_window",
        ),
        pytest.param(
            _with(SMOLLM2_135M, num_key_value_heads=4),
            "num_attention_heads (9) must be a multiple of num_key_value_heads (4)",
            id="kv_heads",
        ),
        pytest.param(
            _with(LLAMA_31_8B, pretraining_tp=2),
            "pretraining_tp=2 is not supported (only 1)",
            id="pretraining_tp",
        ),
    ],
)
def test_refused_settings_name_the_setting(hf: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize(
    ("hf", "message"),
    [
        pytest.param(
            {k: v for k, v in SMOLLM2_135M.items() if k != "num_attention_heads"},
            "m/config.json has no num_attention_heads",
            id="heads-missing",
        ),
        pytest.param(
            _with(SMOLLM2_135M, num_attention_heads=0, head_dim=None),
            "m/config.json: num_attention_heads must be a positive integer, got 0",
            id="heads-zero",
        ),
        pytest.param(
            _with(LLAMA_31_8B, hidden_size="4096"),
            "m/config.json: hidden_size must be a positive integer, got '4096'",
            id="hidden_size-string",
        ),
        pytest.param(
            _with(SMOLLM2_135M, head_dim=-64),
            "m/config.json: head_dim must be a positive integer, got -64",
            id="head_dim-negative",
        ),
        pytest.param(
            [SMOLLM2_135M], "m/config.json is not a JSON object, got list", id="not-an-object"
        ),
    ],
)
def test_missing_or_bad_sizes_name_the_file_and_the_key(hf: Any, message: str) -> None:
    """A damaged config.json was a KeyError or ZeroDivisionError traceback at start-up."""
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        ModelConfig.from_hf(hf, "m/config.json")


def test_absent_kv_heads_and_head_dim_are_still_derived() -> None:
    hf = _with(LLAMA_31_8B, num_key_value_heads=None, head_dim=0)
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.num_kv_heads, cfg.head_dim) == (32, 128)
