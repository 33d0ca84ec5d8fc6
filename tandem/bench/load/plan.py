"""``tandem plan``: what fits on a decode worker, and how many workers a target rate needs.

Memory, from the model's config and the hardware:
    KV bytes per token = 2 (K and V) x layers x KV heads x head size x dtype bytes
(KV heads, not attention heads: grouped-query attention shares each KV head among
several query heads). A worker of N devices is N tensor-parallel ranks, laid out
as Tandem's engine lays them (tandem/engine/parallel.py): each rank holds 1/N of
the query heads and of the MLP, its share of the KV heads (one, replicated, when
there are fewer KV heads than ranks), and the whole embedding and LM head. So every
figure is per rank: the KV cache of a rank is ``memory x utilisation - its
weights``, cut into blocks of ``block_size`` tokens of its KV heads; every rank has
the same number of blocks, and a sequence of ``context`` tokens holds
``ceil(context / block_size)`` of them.
Activation workspace is not subtracted: lower the utilisation to leave room for it.

Workers, from a ``tandem bench sweep`` result: the deployment that was swept (P
prefill + D decode workers) sustained C req/s within the SLOs. A target of R req/s
with the same workload needs ``ceil(R / C x P)`` prefill and ``ceil(R / C x D)``
decode workers (the sweep cannot tell which pool saturated first, so both scale);
decode is also bounded by KV memory: by Little's law ``R x mean E2E`` requests hold
decode KV at once, each ``ceil((prompt + output) / block_size)`` blocks. A colocated
deployment (P = 0) scales its decode workers only.

A Tandem worker holds the KV cache that ``engine.kv_cache_bytes`` (per rank) sets,
512 MiB unless told: the plan prints the value that gives its KV budget.

Every figure is printed with the arithmetic behind it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tandem.config import EngineConfig
from tandem.engine.model_config import ModelConfig
from tandem.errors import InvalidRequestError
from tandem.kernels import INT8_SCALE_BYTES

GiB = 1 << 30
DEFAULT_KV_CACHE_BYTES = EngineConfig().kv_cache_bytes
DEFAULT_MAX_NUM_SEQS = EngineConfig().max_num_seqs
DEFAULT_MAX_NUM_BATCHED_TOKENS = EngineConfig().max_num_batched_tokens
# A Tandem engine computes in its ``dtype`` (engine.dtype) and keeps its KV cache in
# that dtype or in int8 (engine.kv_cache_dtype: auto | int8): those are the only
# pairs a plan can be deployed with.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MODEL_DTYPES = ("bfloat16", "float16", "float32")
KV_DTYPES = ("auto", "int8", *MODEL_DTYPES)


@dataclass(frozen=True)
class Hardware:
    device_memory_gib: float = 80.0
    devices_per_worker: int = 1  # decode workers' tensor_parallel_size
    prefill_devices_per_worker: int = 1  # prefill workers' (device totals only)
    memory_utilization: float = 0.9
    # engine.kv_cache_dtype: auto (the weights' dtype) or int8; a float dtype is taken
    # as auto with the weights in that dtype (it cannot differ from weight_dtype)
    kv_dtype: str = "auto"
    weight_dtype: str | None = None  # engine.dtype; default: a float kv_dtype, else bfloat16
    block_size: int = 16

    def __post_init__(self) -> None:
        kv, weights = dtype_name(self.kv_dtype), dtype_name(self.weight_dtype)
        if kv not in KV_DTYPES:
            raise InvalidRequestError(
                "--kv-dtype", f"--kv-dtype must be one of {', '.join(KV_DTYPES)} (a Tandem KV "
                f"cache is the model's dtype or int8: engine.kv_cache_dtype), got {self.kv_dtype!r}"
            )  # fmt: skip
        if weights is not None and weights not in MODEL_DTYPES:
            raise InvalidRequestError(
                "--weight-dtype", f"--weight-dtype must be one of {', '.join(MODEL_DTYPES)} "
                f"(engine.dtype), got {self.weight_dtype!r}"
            )  # fmt: skip
        if kv in MODEL_DTYPES and weights not in (None, kv):
            raise InvalidRequestError(
                "--kv-dtype", f"--kv-dtype {self.kv_dtype} with --weight-dtype "
                f"{self.weight_dtype}: a Tandem engine keeps its KV cache in its own dtype "
                "or in int8 (--kv-dtype auto or int8)"
            )  # fmt: skip
        if not (math.isfinite(self.device_memory_gib) and self.device_memory_gib > 0):
            raise InvalidRequestError("device_memory_gib", "--device-memory-gib must be > 0 "
                                      f"and finite, got {self.device_memory_gib}")  # fmt: skip
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError("block_size", "--block-size must be a power of two >= 1 "
                                      f"(as engine.block_size), got {self.block_size}")  # fmt: skip
        if min(self.devices_per_worker, self.prefill_devices_per_worker, self.block_size) < 1:
            raise InvalidRequestError("hardware", "--decode-tp, --prefill-tp and --block-size "
                                      "must be >= 1")  # fmt: skip
        if not 0 < self.memory_utilization <= 1:
            raise InvalidRequestError("memory_utilization", "--memory-utilization must be in "
                                      f"(0, 1], got {self.memory_utilization}")  # fmt: skip


def row_bytes(mc: ModelConfig, kv_dtype: str) -> int:
    """One token's K (or V) of one KV head."""
    scale = INT8_SCALE_BYTES if kv_dtype == "int8" else 0
    return mc.head_dim * DTYPE_BYTES[dtype_name(kv_dtype)] + scale


def kv_bytes_per_token(mc: ModelConfig, kv_dtype: str) -> int:
    """Of the whole model (a rank's: ``kv_bytes_per_token(rank_config(mc, n), ...)``)."""
    return 2 * mc.num_layers * mc.num_kv_heads * row_bytes(mc, kv_dtype)


def rank_config(mc: ModelConfig, n: int) -> ModelConfig:
    """The model as one of ``n`` tensor-parallel ranks holds it (refused by name if ``n``
    does not split it)."""
    from tandem.engine.parallel import Shard, check_tensor_parallel
    from tandem.errors import ConfigError

    try:
        check_tensor_parallel(mc, n)
    except ConfigError as exc:
        raise InvalidRequestError("devices_per_worker", str(exc)) from exc
    return Shard(0, n).config(mc)


def dtype_name(dtype: str | None) -> str | None:
    return DTYPE_ALIASES.get(dtype, dtype) if dtype is not None else None


def weight_dtype(hw: Hardware) -> str:
    """The weights' dtype (engine.dtype): as given, else a float --kv-dtype, else bf16."""
    kv = dtype_name(hw.kv_dtype)
    return dtype_name(hw.weight_dtype) or (kv if kv in MODEL_DTYPES else "bfloat16")


def cache_dtype(hw: Hardware) -> str:
    """The KV cache's dtype: int8, or the weights' (engine.kv_cache_dtype auto)."""
    return "int8" if dtype_name(hw.kv_dtype) == "int8" else weight_dtype(hw)


def param_count(mc: ModelConfig) -> int:
    """Parameters of the Llama-family decoder Tandem runs (embeddings, layers, norms, head)."""
    h, q, kv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    # (of a rank's config: its heads and MLP slice; hidden size, embedding and head whole)
    attn = h * q + 2 * h * kv + q * h
    attn += (q + 2 * kv) * mc.qkv_bias + h * mc.o_bias
    mlp = 3 * h * mc.intermediate_size + (2 * mc.intermediate_size + h) * mc.mlp_bias
    layer = attn + mlp + 2 * h  # two RMSNorm weights
    embed = mc.vocab_size * h
    head = 0 if mc.tie_word_embeddings else mc.vocab_size * h
    return embed + mc.num_layers * layer + h + head


@dataclass(frozen=True)
class MemoryPlan:
    kv_bytes_per_token: int  # per rank, as weight_bytes and kv_budget_bytes
    weight_bytes: int
    kv_budget_bytes: int
    num_blocks: int
    tokens: int
    context_len: int
    blocks_per_seq: int
    sequences: int
    lines: tuple[str, ...]  # the arithmetic, for the operator to check


def memory_plan(mc: ModelConfig, hw: Hardware, context_len: int, model: str = "") -> MemoryPlan:
    """What fits on one decode worker of ``hw.devices_per_worker`` ranks (figures per rank)."""
    if context_len < 1:
        raise InvalidRequestError("context_len", f"--context-len must be >= 1, got {context_len}")
    if context_len > mc.max_position_embeddings:  # every such request would be refused
        raise InvalidRequestError(
            "context_len", f"--context-len {context_len} is longer than the model's context "
            f"({mc.max_position_embeddings} tokens, max_position_embeddings)",
        )  # fmt: skip
    n = hw.devices_per_worker
    rank = rank_config(mc, n)
    rank_config(mc, hw.prefill_devices_per_worker)  # the prefill pool's width splits it too
    w_dtype, kv_dtype = weight_dtype(hw), cache_dtype(hw)
    per_token = kv_bytes_per_token(rank, kv_dtype)
    params = param_count(rank)
    weights = params * DTYPE_BYTES[w_dtype]
    budget = max(0, int(hw.device_memory_gib * GiB * hw.memory_utilization) - weights)
    block_bytes = hw.block_size * per_token
    blocks = budget // block_bytes
    per_seq = math.ceil(context_len / hw.block_size)
    seqs = blocks // per_seq
    gqa = f" (GQA: {mc.num_heads} query heads share them)" if mc.num_kv_heads < mc.num_heads else ""
    lines = [
        f"model {model}: {mc.num_layers} layers, {mc.num_kv_heads} KV heads{gqa}, "
        f"head size {mc.head_dim}, {param_count(mc) / 1e9:.3f} B parameters",
    ]
    per = ""
    if n > 1:
        shared = f", replicated on {n // mc.num_kv_heads} ranks" if mc.num_kv_heads < n else ""
        lines.append(
            f"tensor parallel, {n} ranks: each holds {rank.num_heads} query heads, "
            f"{rank.num_kv_heads} KV head(s){shared}, 1/{n} of the MLP, and the whole "
            "embedding and LM head"
        )
        per = " per rank"
    lines += [
        f"KV bytes per token{per} = 2 x {mc.num_layers} layers x {rank.num_kv_heads} KV heads x "
        f"{row_bytes(mc, kv_dtype)} B per head ({mc.head_dim} x "
        f"{DTYPE_BYTES[kv_dtype]} B {kv_dtype}"
        f"{' + a 2 B scale' if kv_dtype == 'int8' else ''}) = {per_token:,} B "
        f"({per_token / 1024:.1f} KiB)",
        f"weights{per} = {params:,} parameters x {DTYPE_BYTES[w_dtype]} B ({w_dtype}) = "
        f"{weights / GiB:.2f} GiB",
        f"KV budget{per or ' per decode worker'} = {hw.device_memory_gib:g} GiB x "
        f"{hw.memory_utilization:g} - {weights / GiB:.2f} GiB weights = {budget / GiB:.2f} GiB",
        f"blocks{' (the same on every rank)' if n > 1 else ''} = {budget:,} B // "
        f"({hw.block_size} tokens x {per_token:,} B) = {blocks:,} blocks = "
        f"{blocks * hw.block_size:,} tokens",
        f"at {context_len:,} tokens of context: ceil({context_len} / {hw.block_size}) = "
        f"{per_seq} blocks per sequence; {blocks:,} // {per_seq} = {seqs:,} sequences per "
        "decode worker",
    ]
    if budget == 0:
        lines.append("the weights do not leave room for a KV cache: more memory, a wider "
                     "--decode-tp or a smaller --weight-dtype")  # fmt: skip
    elif seqs == 0:
        lines.append(f"a decode worker holds no sequence of {context_len:,} tokens: more "
                     "memory, a wider --decode-tp, --kv-dtype int8 or a shorter "
                     "--context-len")  # fmt: skip
    else:
        default = DEFAULT_KV_CACHE_BYTES // block_bytes
        lines.append(
            f"deploy with engine.kv_cache_bytes: {budget}{per} (the default, "
            f"{DEFAULT_KV_CACHE_BYTES // 2**20} MiB, holds {default:,} blocks = "
            f"{default // per_seq:,} sequences), engine.dtype: {w_dtype}"
            f"{', engine.kv_cache_dtype: int8' if kv_dtype == 'int8' else ''}"
        )
        if seqs > DEFAULT_MAX_NUM_SEQS:  # a worker runs no more than that, room or not
            lines.append(f"and engine.max_num_seqs: {seqs} (the default, {DEFAULT_MAX_NUM_SEQS}, "
                         "would leave the rest of the blocks unused)")  # fmt: skip
        if seqs > DEFAULT_MAX_NUM_BATCHED_TOKENS:  # a token of a step's budget per stream
            lines.append(f"and engine.max_num_batched_tokens: {seqs} (with the default, "
                         f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}, that many streams take turns "
                         "at the steps)")  # fmt: skip
    return MemoryPlan(per_token, weights, budget, blocks, blocks * hw.block_size,
                      context_len, per_seq, seqs, tuple(lines))  # fmt: skip


@dataclass(frozen=True)
class WorkerPlan:
    prefill_workers: int
    decode_workers: int
    lines: tuple[str, ...]


def worker_plan(
    sweep: dict,
    target_rate: float,
    memory: MemoryPlan | None,
    block_size: int = 16,
    hw: Hardware | None = None,
) -> WorkerPlan:
    """``hw``: the pools' widths, for the device count (default: one device a worker)."""
    if not target_rate > 0:
        raise InvalidRequestError("target_rate", f"--target-rate must be > 0, got {target_rate}")
    cap, idx = sweep.get("capacity_rps"), sweep.get("capacity_point")
    if cap is None or idx is None:
        raise InvalidRequestError(
            "sweep", f"the sweep found no point with SLO attainment >= "
            f"{sweep.get('target_attainment', 0.9):.0%}: sweep lower rates first"
        )  # fmt: skip
    dep = sweep["deployment"]
    p, d = dep["prefill_workers"], dep["decode_workers"]
    s = sweep["points"][idx]["summary"]
    scale = target_rate / cap
    prefill = math.ceil(scale * p - 1e-9)
    decode_thr = math.ceil(scale * d - 1e-9)
    slo = sweep.get("slo") or {}
    slo_text = ", ".join(f"{k[:-3].upper()} <= {v:g} ms" for k, v in slo.items() if v) or "none"
    lines = [
        f"sweep: {p} prefill + {d} decode workers sustained {cap:.3g} req/s with SLO "
        f"attainment >= {sweep['target_attainment']:.0%} (SLOs: {slo_text})",
        f"scale = {target_rate:g} / {cap:.3g} = {scale:.3f}",
        f"prefill workers = ceil({scale:.3f} x {p}) = {prefill}",
        f"decode workers for throughput = ceil({scale:.3f} x {d}) = {decode_thr}",
    ]
    decode = decode_thr
    if memory is not None and s["completed"]:
        tokens = (s["input_tokens"] + s["output_tokens"]) / s["completed"]
        e2e_s = (s["e2e_ms"]["mean"] or 0) / 1e3
        in_flight = target_rate * e2e_s
        per_seq = math.ceil(tokens / block_size)
        fits = memory.num_blocks // per_seq
        if not fits:
            raise InvalidRequestError(
                "memory", f"a decode worker's {memory.num_blocks:,} KV blocks do not hold one "
                f"of the sweep's requests ({tokens:.0f} tokens = {per_seq} blocks): more "
                "memory, a wider --decode-tp or --kv-dtype int8",
            )  # fmt: skip
        decode_mem = math.ceil(in_flight / fits - 1e-9)
        decode = max(decode_thr, decode_mem)
        lines += [
            f"decode KV: {target_rate:g} req/s x {e2e_s:.2f} s mean E2E = {in_flight:.1f} "
            f"requests in flight; {tokens:.0f} tokens each = {per_seq} blocks; "
            f"{memory.num_blocks:,} // {per_seq} = {fits:,} per worker",
            f"decode workers for KV memory = ceil({in_flight:.1f} / {fits:,}) = {decode_mem}",
        ]
    hw = hw or Hardware()
    pt, dt = hw.prefill_devices_per_worker, hw.devices_per_worker
    devices = prefill * pt + decode * dt
    lines.append(f"plan: {prefill} prefill + {decode} decode workers for {target_rate:g} req/s")
    lines.append(f"devices = {prefill} x {pt} (prefill TP) + {decode} x {dt} (decode TP) = "
                 f"{devices}")  # fmt: skip
    return WorkerPlan(prefill, decode, tuple(lines))


def read_sweep(path: str | Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError("sweep", f"cannot read sweep result {path}: {exc}") from None
    if not isinstance(data, dict) or "points" not in data or "deployment" not in data:
        raise InvalidRequestError("sweep", f"{path} is not a sweep.json from tandem bench sweep")
    return data


def model_config(model: str) -> ModelConfig:
    """From a built-in name, a Hugging Face directory (or its config.json) or a GGUF."""
    path = Path(model).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        try:
            return ModelConfig.from_hf(json.loads(path.read_text()), str(path))
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidRequestError("model", f"cannot read {path}: {exc}") from None
    from tandem.engine.loader import read_model_config

    source = str(path / "config.json") if path.is_dir() else model
    return ModelConfig.from_hf(read_model_config(model), source)
