"""``tiny-random``: a small Llama for fast tests, fully determined by this file.

Weights come from a fixed seed with a scale large enough that the next-token
distribution is peaked (Hugging Face's default init gives near-uniform logits,
where any two implementations would disagree on ties). The tokenizer is
byte-level with no merges, so every non-ASCII character spans several tokens:
the hardest case for streaming UTF-8.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 128, 4, 4, 2


def config_dict(vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(byte_vocab):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[],
    )
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def random_state_dict(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def linear(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) * (gain / in_f**0.5)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    state = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=gen)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = linear(heads * d, h, 2.0)
        state[p + "self_attn.k_proj.weight"] = linear(kv * d, h, 2.0)
        state[p + "self_attn.v_proj.weight"] = linear(kv * d, h)
        state[p + "self_attn.o_proj.weight"] = linear(h, heads * d)
        state[p + "mlp.gate_proj.weight"] = linear(inter, h)
        state[p + "mlp.up_proj.weight"] = linear(inter, h)
        state[p + "mlp.down_proj.weight"] = linear(h, inter)
        state[p + "input_layernorm.weight"] = norm(h)
        state[p + "post_attention_layernorm.weight"] = norm(h)
    state["model.norm.weight"] = norm(h)
    # A large output scale makes the next-token distribution peaked (few near-ties).
    state["lm_head.weight"] = linear(cfg["vocab_size"], h, 8.0)
    return state


def write_tiny_random(out: Path) -> None:
    from safetensors.torch import save_file

    tok = build_tokenizer()
    cfg = config_dict(len(tok))
    save_file(random_state_dict(cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(out)
