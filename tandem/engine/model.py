"""Llama-family decoder (Llama, Qwen2, SmolLM) over a paged KV cache.

One forward serves any mix of sequences: the flat token batch holds the decode
tokens first (one per sequence) and then the prefill chunks; positions and the
attention metadata say where each token sits in its sequence and where its K/V
lives. Parameter names follow Hugging Face so checkpoints load by name; q/k/v
and gate/up are fused at load time to halve the matmul launches per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import gguf_int4
from tandem.engine.model_config import ModelConfig
from tandem.engine.rope import apply_rope, rope_cache, signed_sin
from tandem.kernels.cpu import norm as cpu_norm
from tandem.kernels.cpu import step_ops as cpu_ops


@dataclass
class PrefillSlice:
    """One sequence's new tokens in the flat batch (query_len > 1 or a first token)."""

    start: int  # offset in the flat batch
    query_len: int
    context_len: int  # cached prefix + query_len
    block_table: torch.Tensor  # [n_blocks], int64


@dataclass
class AttentionMetadata:
    """Built once per step and shared by every layer."""

    slot_mapping: torch.Tensor  # [tokens], int64: where each new token's K/V is stored
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks], int64
    decode_context_lens: torch.Tensor | None  # [num_decode], int64
    decode_max_len: int
    prefills: list[PrefillSlice]


class Linear(nn.Linear):
    """``nn.Linear`` that runs, on CPU, from a weight reordered once into oneDNN's layout.

    oneDNN's matmul from a prepacked weight (what Inductor's CPU backend uses for
    frozen weights) was 1.3-2.8x faster here than ``F.linear`` on the skinny inputs of
    a decode step, and 1.1-1.4x on prefill chunks, in float32 and in bfloat16
    (``bench/linear_forms.py``). Without a bias, bfloat16 results are bit-identical to
    ``F.linear``; float32 ones equal up to rounding. ``pack`` reorders once the weights
    are final; until then, and on other devices, it is ``F.linear``. ``use_int4`` adds
    a GGUF's codes for steps of a few rows (tandem/engine/gguf_int4.py).
    """

    packed: torch.Tensor | None = None
    # A GGUF's codes (gguf_int4.Forms: 4-bit projections, an 8-bit LM head) for steps
    # of at most int4_max_rows rows.
    int4: gguf_int4.Forms | None = None
    int4_max_rows = 0

    def use_int4(self, forms: gguf_int4.Forms, max_rows: int):
        self.int4, self.int4_max_rows = forms, max_rows

    def pack(self, keep_dense: bool = False) -> bool:
        """Reorder the weight for oneDNN; False (and nothing changed) where it cannot run.

        The dense weight is dropped unless ``keep_dense`` (a tied lm_head shares it
        with the embedding): the packed copy replaces it, not doubles it.
        """
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            # A dtype this CPU's oneDNN cannot compute in fails here, not in a step.
            probe = torch.zeros(1, self.in_features, dtype=self.weight.dtype)
            _packed_linear(probe, packed, self.bias)
        except (AttributeError, RuntimeError):
            return False
        self.packed = packed
        if not keep_dense:
            self.register_parameter("weight", None)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        # No rows (the LM head of a step that samples nothing: a prompt's middle chunk)
        # is torch's case: the codes' kernels take 1 row and more.
        if self.int4 is not None and 0 < rows <= self.int4_max_rows:
            codes = self.int4
            if codes.f32_codes is not None:  # float32: the only form of the codes
                if rows <= gguf_int4.F32_MAX_ROWS:
                    return gguf_int4.f32_linear(x, codes, self.bias)
                return self._dense(x)
            # torch's kernel is the faster below AMX_MIN_ROWS, where it has the codes.
            amx_rows = 1 if codes.packed is None else gguf_int4.AMX_MIN_ROWS
            if codes.tiles is not None and amx_rows <= rows <= gguf_int4.AMX_MAX_ROWS:
                return gguf_int4.amx_linear(x, codes, self.bias)
            if codes.packed is not None and rows <= gguf_int4.TORCH_MAX_ROWS:
                out = torch._weight_int4pack_mm_for_cpu(
                    x, codes.packed, gguf_int4.GROUP, codes.scales_and_zeros
                )
                return out if self.bias is None else out + self.bias
        return self._dense(x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return _packed_linear(x, self.packed, self.bias)
        return super().forward(x)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_norm.rms_norm(x, self.weight, self.eps)
        if fused is not None:
            return fused[1]
        # rms_norm computes in float32 and casts back before the weight multiplies, as
        # HF's LlamaRMSNorm does in 16-bit dtypes (bit-identical: tests/engine/test_layers.py).
        return self.weight * F.rms_norm(x, self.weight.shape, None, self.eps)

    def add(self, h: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + out, this norm of it): a residual add and the norm after it, in one call
        on a CPU in bfloat16 (tandem/kernels/cpu/rms_norm.c)."""
        fused = cpu_norm.rms_norm(out, self.weight, self.eps, residual=h)
        if fused is not None:
            return fused
        h = h + out
        return h, self(h)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        # An int8 KV cache's per-channel factors (tandem/engine/k_balance.py): K is
        # stored times k_balance and queries are divided by it, which leaves the scores.
        self.register_buffer("k_balance", None)  # [kv_heads, head_dim]
        self.register_buffer("q_balance", None)  # [heads, head_dim]: 1 / its group's

    def set_k_balance(self, factors: torch.Tensor) -> None:
        group = self.num_heads // self.num_kv_heads
        self.k_balance = factors
        self.q_balance = factors.reciprocal().repeat_interleave(group, 0)

    def forward(
        self,
        x: torch.Tensor,  # [tokens, hidden]
        cos: torch.Tensor,  # [tokens, head_dim]
        sin_signed: torch.Tensor,  # rope.signed_sin
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        ops,
    ) -> torch.Tensor:
        n = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # Rotate q and k in one go: they are adjacent heads of the fused projection.
        qk = qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        rotated = cpu_ops.rope(qk, cos, sin_signed)
        qk = apply_rope(qk, cos, sin_signed) if rotated is None else rotated
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        if self.k_balance is not None:
            q, k = q * self.q_balance, k * self.k_balance
        v = v.view(n, self.num_kv_heads, self.head_dim)
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

        d = meta.num_decode
        if d:
            decoded = ops.decode_attention(
                q[:d],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                meta.decode_max_len,
                self.scale,
            )
            if d == n:  # a pure decode step: no copy into a shared output
                return self.o_proj(decoded.reshape(n, self.q_size))
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        if d:
            out[:d] = decoded
        for p in meta.prefills:
            s = slice(p.start, p.start + p.query_len)
            out[s] = ops.prefill_attention(
                q[s],
                k_cache,
                v_cache,
                p.block_table,
                p.context_len,
                self.scale,
                new_kv=(k[s], v[s]),
            )
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    # Tensor parallelism (parallel.py): sums a row-parallel output over the ranks in
    # place; None on one device.
    all_reduce: Callable[[torch.Tensor], None] | None = None

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_cache(cfg, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_positions, head_dim]
        self.register_buffer("rope_sin_signed", signed_sin(sin), persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens], int64
        positions: torch.Tensor,  # [tokens], int64
        kv_cache: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        ops,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm: [tokens, hidden]. ``after_layer(i)`` runs
        once layer i's KV for these tokens is in ``kv_cache`` (layer-wise KV shipping)."""
        h = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(h.dtype)
        sin_signed = self.rope_sin_signed[positions].to(h.dtype)
        reduce = self.all_reduce
        layers = self.layers
        # Each residual add is done by the norm that follows it (RMSNorm.add).
        normed = layers[0].input_layernorm(h)
        for i, layer in enumerate(layers):
            out = layer.self_attn(
                normed, cos, sin_signed, kv_cache[i, 0], kv_cache[i, 1], meta, ops
            )
            if reduce is not None:
                reduce(out)
            h, normed = layer.post_attention_layernorm.add(h, out)
            if after_layer is not None:
                after_layer(i)
            out = layer.mlp(normed)
            if reduce is not None:
                reduce(out)
            following = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            h, normed = following.add(h, out)
        return normed

    def pack_for_cpu(self) -> bool:
        """Prepack every projection for oneDNN (``Linear.pack``); call once the model is
        on the CPU in its final dtype. False if this CPU's oneDNN cannot."""
        if not torch.backends.mkldnn.is_available():
            return False
        tied = self.lm_head.weight is self.embed_tokens.weight
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        # A list, not a generator: every projection is tried even if one cannot pack.
        packed = [m.pack(keep_dense=tied and m is self.lm_head) for m in linears]
        return all(packed)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32."""
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face parameter names, fusing q/k/v and gate/up."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, value: torch.Tensor) -> None:
            if name not in own:
                return
            param = own[name]
            if param.shape != value.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(value.shape)}, model {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(value)
            loaded.add(name)

        for i in range(self.cfg.num_layers):
            p = f"model.layers.{i}."
            for kind in ("weight", "bias"):
                parts = [tensors.get(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"]
                if all(t is not None for t in parts):
                    put(f"layers.{i}.self_attn.qkv_proj.{kind}", torch.cat(parts))
                parts = [tensors.get(f"{p}mlp.{x}_proj.{kind}") for x in ("gate", "up")]
                if all(t is not None for t in parts):
                    put(f"layers.{i}.mlp.gate_up_proj.{kind}", torch.cat(parts))
        for name, value in tensors.items():
            if ".q_proj." in name or ".k_proj." in name or ".v_proj." in name:
                continue
            if ".gate_proj." in name or ".up_proj." in name:
                continue
            put(name.removeprefix("model."), value)
        if self.cfg.tie_word_embeddings:
            loaded.add("lm_head.weight")
        missing = sorted(set(own) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
