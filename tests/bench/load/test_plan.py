"""``tandem plan`` against hand computations: SmolLM2-135M and a Llama-3-70B-shaped config."""

from __future__ import annotations

import json
import math

import pytest

from tandem.bench.load import plan
from tandem.bench.load.plan import Hardware
from tandem.errors import ConfigError, InvalidRequestError

GiB = 2**30

LLAMA_70B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
}  # fmt: skip


@pytest.fixture(scope="module")
def smol():
    return plan.model_config("smollm2-135m-instruct")  # the GGUF's metadata, no weights


@pytest.fixture
def llama70b(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_70B))
    return plan.model_config(str(path))


def test_smollm2_architecture_as_its_config_states(smol):
    assert (smol.num_layers, smol.num_heads, smol.num_kv_heads, smol.head_dim) == (30, 9, 3, 64)


def test_smollm2_kv_bytes_weights_and_what_fits(smol):
    # 2 (K, V) x 30 layers x 3 KV heads x 64 x 2 bytes (bf16)
    assert plan.kv_bytes_per_token(smol, "bfloat16") == 2 * 30 * 3 * 64 * 2 == 23_040
    assert plan.kv_bytes_per_token(smol, "float32") == 46_080
    # Tied embeddings 49152 x 576; per layer q, o 576^2, k, v 576 x 192, MLP 3 x 576 x 1536,
    # two norms; a final norm.
    layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
    assert plan.param_count(smol) == 49152 * 576 + 30 * layer + 576 == 134_515_008
    m = plan.memory_plan(smol, Hardware(device_memory_gib=80), context_len=4096)
    budget = int(80 * GiB * 0.9) - 134_515_008 * 2
    assert m.kv_budget_bytes == budget == 77_040_381_312
    assert m.num_blocks == budget // (16 * 23_040) == 208_985
    assert m.tokens == 208_985 * 16
    assert m.blocks_per_seq == 256 and m.sequences == 208_985 // 256 == 816
    text = "\n".join(m.lines)
    assert "2 x 30 layers x 3 KV heads x 128 B per head (64 x 2 B bfloat16) = 23,040 B" in text
    assert "816 sequences per decode worker" in text


def test_int8_kv_counts_its_scales_and_keeps_bf16_weights(smol):
    # Tandem's int8 rows: 64 values and a 2-byte float16 scale per KV head.
    assert plan.kv_bytes_per_token(smol, "int8") == 2 * 30 * 3 * (64 + 2) == 11_880
    m8 = plan.memory_plan(smol, Hardware(kv_dtype="int8"), context_len=4096)
    m16 = plan.memory_plan(smol, Hardware(kv_dtype="bfloat16"), context_len=4096)
    assert m8.weight_bytes == m16.weight_bytes == 134_515_008 * 2  # weights stay bf16
    assert m8.sequences / m16.sequences >= 1.9
    assert "66 B per head (64 x 1 B int8 + a 2 B scale) = 11,880 B" in "\n".join(m8.lines)


def test_70b_style_config_with_gqa_and_eight_devices(llama70b):
    assert llama70b.head_dim == 8192 // 64 == 128
    assert plan.kv_bytes_per_token(llama70b, "bf16") == 2 * 80 * 8 * 128 * 2 == 327_680
    layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    params = 2 * 128256 * 8192 + 80 * layer + 8192
    assert plan.param_count(llama70b) == params == 70_553_706_496
    hw = Hardware(device_memory_gib=80, devices_per_worker=8, memory_utilization=0.9)
    m = plan.memory_plan(llama70b, hw, context_len=4096)
    # Per rank of 8: 8 query heads, 1 KV head, 28672 / 8 MLP; embedding and head whole.
    assert m.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2 == 40_960
    rank_layer = 8192 * 1024 + 2 * 8192 * 128 + 1024 * 8192 + 3 * 8192 * 3584 + 2 * 8192
    rank_params = 2 * 128256 * 8192 + 80 * rank_layer + 8192
    assert m.weight_bytes == 2 * rank_params == 2 * 10_659_045_376
    assert m.kv_budget_bytes == int(80 * GiB * 0.9) - 2 * rank_params == 55_991_320_576
    assert m.num_blocks == 55_991_320_576 // (16 * 40_960) == 85_435
    assert m.sequences == 85_435 // 256 == 333
    assert "each holds 8 query heads, 1 KV head(s), 1/8 of the MLP" in m.lines[1]
    assert "GQA: 64 query heads share them" in m.lines[0]


def test_more_ranks_than_kv_heads_replicate_them_and_a_width_must_split_the_model(llama70b, smol):
    m = plan.memory_plan(llama70b, Hardware(devices_per_worker=16), context_len=4096)
    assert m.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2  # one KV head a rank, shared by two
    assert "1 KV head(s), replicated on 2 ranks" in m.lines[1]
    three = plan.memory_plan(smol, Hardware(devices_per_worker=3), context_len=4096)
    assert three.kv_bytes_per_token == plan.kv_bytes_per_token(smol, "bfloat16") // 3
    assert three.sequences > 2.9 * plan.memory_plan(smol, Hardware(), 4096).sequences
    with pytest.raises(InvalidRequestError, match=r"tensor_parallel_size 2 must divide "
                       r"num_attention_heads \(9\)"):  # fmt: skip
        plan.memory_plan(smol, Hardware(devices_per_worker=2), context_len=4096)


def test_weights_that_do_not_fit_leave_no_kv(llama70b):
    m = plan.memory_plan(llama70b, Hardware(device_memory_gib=80), context_len=4096)
    assert (m.kv_budget_bytes, m.num_blocks, m.sequences) == (0, 0, 0)
    assert "do not leave room for a KV cache" in m.lines[-1]


def _sweep(capacity=4.0, point=None):
    summary = {"completed": 10, "input_tokens": 10 * 1000, "output_tokens": 10 * 500,
               "e2e_ms": {"mean": 20_000.0}}  # fmt: skip
    return {
        "deployment": {"prefill_workers": 1, "decode_workers": 2},
        "slo": {"ttft_ms": 500.0, "tpot_ms": 50.0},
        "target_attainment": 0.9,
        "capacity_rps": capacity,
        "capacity_point": point,
        "points": [{"x": capacity, "summary": summary}],
    }


def test_workers_for_a_target_rate_by_throughput_and_by_kv_memory(smol):
    memory = plan.memory_plan(smol, Hardware(device_memory_gib=80), 4096)
    memory = plan.MemoryPlan(**{**memory.__dict__, "num_blocks": 94 * 30})  # 30 sequences fit
    w = plan.worker_plan(_sweep(point=0), target_rate=10.0, memory=memory)
    # scale 10 / 4 = 2.5: prefill ceil(2.5 x 1) = 3, decode ceil(2.5 x 2) = 5 for throughput;
    # KV: 10 req/s x 20 s = 200 in flight, 1500 tokens = 94 blocks each, 30 per worker -> 7.
    assert (w.prefill_workers, w.decode_workers) == (3, math.ceil(200 / 30)) == (3, 7)
    assert "scale = 10 / 4 = 2.500" in w.lines[1]
    assert w.lines[-2] == "plan: 3 prefill + 7 decode workers for 10 req/s"
    assert w.lines[-1] == "devices = 3 x 1 (prefill TP) + 7 x 1 (decode TP) = 10"
    wide = plan.worker_plan(_sweep(point=0), 10.0, memory, hw=Hardware(
        devices_per_worker=2, prefill_devices_per_worker=4))  # fmt: skip
    assert wide.lines[-1] == "devices = 3 x 4 (prefill TP) + 7 x 2 (decode TP) = 26"
    exact = plan.worker_plan(_sweep(point=0), target_rate=8.0, memory=None)
    assert (exact.prefill_workers, exact.decode_workers) == (2, 4)


def test_the_plan_says_which_kv_cache_bytes_give_its_budget(smol):
    m = plan.memory_plan(smol, Hardware(device_memory_gib=80), 4096)
    per_block = 16 * m.kv_bytes_per_token
    default = 512 * 2**20 // per_block  # what a worker holds unless told
    assert m.lines[-2] == (
        f"deploy with engine.kv_cache_bytes: {m.kv_budget_bytes} (the default, 512 MiB, "
        f"holds {default:,} blocks = {default // 256:,} sequences), engine.dtype: bfloat16"
    )
    assert m.num_blocks == m.kv_budget_bytes // per_block > 100 * default
    # A worker runs at most max_num_seqs (64) sequences, however many blocks it holds.
    assert m.lines[-1] == (
        f"and engine.max_num_seqs: {m.sequences} (the default, 64, would leave the rest of "
        "the blocks unused)"
    )
    # A step gives each running stream a token of its budget (1024 unless told): past
    # that, streams take turns, and their inter-token latency grows with the excess.
    short = plan.memory_plan(smol, Hardware(device_memory_gib=80), 1024)
    assert short.sequences > 1024
    assert short.lines[-1] == (
        f"and engine.max_num_batched_tokens: {short.sequences} (with the default, 1024, "
        "that many streams take turns at the steps)"
    )


def test_a_colocated_deployment_scales_its_decode_workers_only():
    swept = _sweep(point=0)
    swept["deployment"] = {"prefill_workers": 0, "decode_workers": 2}
    w = plan.worker_plan(swept, target_rate=10.0, memory=None)
    assert (w.prefill_workers, w.decode_workers) == (0, 5)
    assert w.lines[-1] == "devices = 0 x 1 (prefill TP) + 5 x 1 (decode TP) = 5"


def test_a_concurrency_sweeps_capacity_is_its_steady_rate_not_the_runs_throughput():
    from tandem.bench.load.runner import LoadConfig
    from tandem.bench.load.sweep import SweepConfig, sweep_json

    # 32 in flight at 0.5 s each: 64 req/s while the run is full; its ramp-down, when
    # fewer are in flight, brought the run's own throughput down to 50.
    summary = {"slo_attainment": 1.0, "request_throughput": 50.0, "e2e_ms": {"mean": 500.0},
               "max_concurrency_seen": 32}  # fmt: skip
    config = SweepConfig(LoadConfig(target="x"), concurrencies=(32,), prefill_workers=0)
    data = sweep_json(config, [{"x": 32, "summary": summary, "model": "m"}])
    assert data["capacity_rps"] == pytest.approx(64.0)
    assert data["deployment"] == {"prefill_workers": 0, "decode_workers": 1}
    # 8 requests never put 64 in flight: the law holds for the 8 the run held.
    held = {**summary, "max_concurrency_seen": 8}
    config = SweepConfig(LoadConfig(target="x"), concurrencies=(64,))
    assert sweep_json(config, [{"x": 64, "summary": held, "model": "m"}])["capacity_rps"] == (
        pytest.approx(16.0)
    )


def test_a_rate_sweeps_capacity_is_what_its_point_sustained_not_what_it_offered():
    # 40 requests offered at 10,000 req/s arrive as one burst; the server kept up with
    # 110 a second. Planning from 10,000 sized one worker pair for 1,000 req/s.
    from tandem.bench.load.runner import LoadConfig
    from tandem.bench.load.sweep import SweepConfig, sweep_json

    def point(x, sustained):
        summary = {"slo_attainment": 1.0, "request_throughput": sustained}
        return {"x": x, "summary": summary, "model": "m"}

    config = SweepConfig(LoadConfig(target="x"), rates=(10, 10000))
    data = sweep_json(config, [point(10, 9.6), point(10000, 110.0)])
    assert (data["capacity_point"], data["capacity_rps"]) == (1, 110.0)
    assert sweep_json(config, [point(10, 10.4)])["capacity_rps"] == 10  # no more than offered
    # Kept up at 1 req/s: its completions came a second apart, though its throughput
    # over the run (24 requests, the last 5.9 s after it was sent) reads 0.83.
    kept = point(1, 0.83)
    kept["summary"]["completion_rate"] = 1.0
    config = SweepConfig(LoadConfig(target="x"), rates=(1,))
    assert sweep_json(config, [kept])["capacity_rps"] == 1.0


def test_a_worker_that_holds_no_request_is_an_error_not_infinite_workers(smol):
    memory = plan.memory_plan(smol, Hardware(device_memory_gib=80), 4096)
    memory = plan.MemoryPlan(**{**memory.__dict__, "num_blocks": 30})  # a request is 94
    with pytest.raises(InvalidRequestError, match="30 KV blocks do not hold one of the "
                       r"sweep's requests \(1500 tokens = 94 blocks\)"):  # fmt: skip
        plan.worker_plan(_sweep(point=0), 10.0, memory)
    small = plan.memory_plan(smol, Hardware(device_memory_gib=0.29), 8192)
    assert small.kv_budget_bytes > 0 and small.sequences == 0
    assert "holds no sequence of 8,192 tokens" in small.lines[-1]
    assert not any(line.startswith("deploy with") for line in small.lines)


def test_a_context_longer_than_the_model_and_a_prefill_width_that_does_not_split_it(smol):
    with pytest.raises(InvalidRequestError, match=r"--context-len 100000 is longer than the "
                       r"model's context \(8192 tokens"):  # fmt: skip
        plan.memory_plan(smol, Hardware(), context_len=100_000)
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size 4 must divide"):
        plan.memory_plan(smol, Hardware(prefill_devices_per_worker=4), context_len=4096)


def test_a_sweep_without_capacity_cannot_plan():
    with pytest.raises(InvalidRequestError, match="no point with SLO attainment >= 90%"):
        plan.worker_plan(_sweep(capacity=None), 1.0, None)


@pytest.mark.parametrize(
    "kv_dtype, weight_dtype, engine_settings",
    [("auto", None, dict(dtype="bfloat16")),
     ("auto", "float32", dict(dtype="float32")),
     ("bf16", None, dict(dtype="bfloat16")),
     ("float32", "float32", dict(dtype="float32")),
     ("int8", None, dict(dtype="bfloat16", kv_cache_dtype="int8")),
     ("int8", "float32", dict(dtype="float32", kv_cache_dtype="int8"))],
)  # fmt: skip
def test_the_plans_blocks_are_what_an_engine_given_its_settings_holds(
    kv_dtype, weight_dtype, engine_settings
):
    # A plan whose KV dtype no engine keeps (fp8; bf16 KV beside float32 weights)
    # printed settings that hold another number of blocks, or that no worker takes.
    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine

    tiny = plan.model_config("tiny-random")
    hw = Hardware(device_memory_gib=0.01, kv_dtype=kv_dtype, weight_dtype=weight_dtype)
    m = plan.memory_plan(tiny, hw, context_len=64)
    settings = dict(engine_settings, kv_cache_bytes=m.kv_budget_bytes)
    deploy = next(line for line in m.lines if line.startswith("deploy with"))
    assert deploy.endswith(", ".join(f"engine.{k}: {v}" for k, v in settings.items()
                                     if k != "kv_cache_bytes"))  # fmt: skip
    engine = LLMEngine(EngineConfig(model="tiny-random", device="cpu", **settings))
    assert engine.kv.null_block == m.num_blocks > 0


@pytest.mark.parametrize(
    "kw, message",
    [(dict(kv_dtype="int3"), "--kv-dtype must be one of"),
     (dict(kv_dtype="fp8"), "--kv-dtype must be one of auto, int8, bfloat16"),
     (dict(weight_dtype="int8"), "--weight-dtype must be one of bfloat16, float16, float32"),
     (dict(kv_dtype="bfloat16", weight_dtype="float32"),
      "--kv-dtype bfloat16 with --weight-dtype float32: a Tandem engine keeps its KV"),
     (dict(memory_utilization=1.5), "--memory-utilization must be in"),
     (dict(device_memory_gib=0), "--device-memory-gib must be > 0 and finite"),
     (dict(device_memory_gib=math.inf), "--device-memory-gib must be > 0 and finite")],
)  # fmt: skip
def test_bad_hardware_names_the_flag(kw, message):
    with pytest.raises(InvalidRequestError, match=message):
        Hardware(**kw)


def test_a_sweep_of_another_model_is_named_beside_the_plan(tmp_path, caplog):
    # A tiny-random sweep planned with the default --model mixed two models' figures
    # without a word.
    import json
    import logging

    from tandem.cli import main

    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({**_sweep(point=0), "model": "smollm2-135m-instruct"}))
    with caplog.at_level(logging.WARNING):
        assert main(["plan", "--model", "tiny-random", "--sweep", str(path),
                     "--target-rate", "8"]) == 0  # fmt: skip
    assert "the sweep measured model 'smollm2-135m-instruct'; the memory below is for " \
           "--model 'tiny-random'" in caplog.text  # fmt: skip


@pytest.mark.parametrize("as_file", [False, True], ids=["directory", "config.json"])
def test_a_config_without_a_size_is_refused_naming_the_file_and_the_key(tmp_path, as_file):
    """`tandem plan --model DIR` was a KeyError traceback, the file's path a ZeroDivisionError."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_70B, "num_attention_heads": 0}))
    with pytest.raises(ConfigError) as err:
        plan.model_config(str(path if as_file else tmp_path))
    assert str(err.value) == f"{path}: num_attention_heads must be a positive integer, got 0"
