"""Tensor parallelism with real processes (gloo on CPU): N ranks give the tokens of one.

The reference is the same engine on one device, in float32: the ranks' partial sums
round differently from one matmul, but greedy tokens match.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import parallel
from tandem.engine.engine import LLMEngine
from tandem.engine.kv_cache import bytes_per_block
from tandem.engine.loader import load_state_dict
from tandem.engine.model_config import ModelConfig
from tandem.engine.parallel import Shard, TensorParallel, check_tensor_parallel
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tiny_random import build_tokenizer, config_dict
from tandem.errors import ConfigError
from tests.conftest import make_engine
from tests.engine.test_architectures import COMMON, VARIANTS, _peaked_random_
from tests.processes import survivors

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [list(range(3, 40)), [11, 12, 13] * 7, [40, 41], list(range(50, 90))]


def _cfg(**overrides) -> ModelConfig:
    return ModelConfig.from_hf({**config_dict(256), **overrides})


def _same_tokens(model: str, tp: int, prompts=PROMPTS, params=GREEDY, **overrides) -> int:
    """Asserts a width-``tp`` engine gives one device's tokens; returns its preemptions."""
    one = make_engine(model, **overrides)
    want = one.generate(prompts, params)
    wide = make_engine(model, tensor_parallel_size=tp, **overrides)
    try:
        assert wide.generate(prompts, params) == want
        wide.kv.pool.check_integrity()
        assert wide.kv.pool.num_used == 0
    finally:
        wide.close()
    assert not any(p.poll() is None for p in wide.tensor_parallel._procs)
    return wide.stats.preemptions


# ---- layout ---------------------------------------------------------------------------


def test_each_rank_loads_its_part_of_the_weights_and_the_parts_reassemble(tmp_path):
    from safetensors.torch import save_file

    cfg = _cfg(num_attention_heads=4, num_key_value_heads=2)
    hd, tensors = cfg.head_dim, {}
    for name, shape in {
        "q_proj.weight": (4 * hd, 64),
        "k_proj.weight": (2 * hd, 64),
        "o_proj.weight": (64, 4 * hd),
        "o_proj.bias": (64,),
    }.items():
        tensors[f"model.layers.0.self_attn.{name}"] = torch.randn(shape)
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.randn(64, 128)
    tensors["model.embed_tokens.weight"] = torch.randn(256, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    # Each rank reads only its slices from the file (never the whole tensor).
    parts = [load_state_dict(tmp_path, lambda n, r=r: Shard(r, 2).part(n, cfg)) for r in range(2)]
    assert parts[0]["model.layers.0.self_attn.q_proj.weight"].shape == (2 * hd, 64)
    p = "model.layers.0."
    for name, dim in (("self_attn.q_proj.weight", 0), ("self_attn.k_proj.weight", 0),
                      ("self_attn.o_proj.weight", 1), ("mlp.down_proj.weight", 1)):  # fmt: skip
        whole = torch.cat([part[p + name] for part in parts], dim)
        assert torch.equal(whole, tensors[p + name]), name
    # A row-parallel bias is added once (rank 0), not once per rank.
    assert torch.equal(parts[0][p + "self_attn.o_proj.bias"], tensors[p + "self_attn.o_proj.bias"])
    assert not parts[1][p + "self_attn.o_proj.bias"].any()
    assert all(torch.equal(part["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
               for part in parts)  # fmt: skip
    local = Shard(1, 2).config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)
    assert local.hidden_size == cfg.hidden_size


def test_fewer_kv_heads_than_ranks_replicates_each_on_the_ranks_that_read_it():
    cfg = _cfg(num_attention_heads=8, num_key_value_heads=2)  # 4 query heads per KV head
    shards = [Shard(r, 4) for r in range(4)]
    assert [s.kv_heads(cfg) for s in shards] == [slice(0, 1)] * 2 + [slice(1, 2)] * 2
    for s in shards:  # every local query head reads the local KV head, as on one device
        group = cfg.num_heads // cfg.num_kv_heads
        q = s.q_heads(cfg)
        assert {h // group for h in range(q.start, q.stop)} == {s.kv_heads(cfg).start}


@pytest.mark.parametrize(
    ("overrides", "size", "named"),
    [
        ({"num_attention_heads": 9, "num_key_value_heads": 3}, 2, "num_attention_heads (9)"),
        ({"num_attention_heads": 12, "num_key_value_heads": 3}, 2, "num_key_value_heads (3)"),
        ({"intermediate_size": 130}, 4, "intermediate_size (130)"),
    ],
)
def test_a_width_that_does_not_split_the_model_is_refused_by_name(overrides, size, named):
    with pytest.raises(ConfigError, match=rf"tensor_parallel_size {size} must divide .*"):
        check_tensor_parallel(_cfg(**overrides), size)
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        check_tensor_parallel(_cfg(**overrides), size)


# ---- real ranks -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "overrides"),
    [
        (2, {}),
        (4, {}),  # 2 KV heads on 4 ranks: each replicated twice
        # A pool small enough to preempt and recompute: re-zeroed blocks on every rank.
        (2, {"num_blocks": 9, "max_num_batched_tokens": 16}),
        (2, {"kv_cache_dtype": "int8"}),
        (2, {"kv_window_tokens": 16, "kv_sink_tokens": 4, "block_size": 4}),
    ],
    ids=["tp2", "tp4-replicated-kv", "tp2-preempt-chunked", "tp2-int8", "tp2-window"],
)
def test_tensor_parallel_tokens_equal_one_device(tp, overrides):
    preemptions = _same_tokens("tiny-random", tp, **overrides)
    assert preemptions or "num_blocks" not in overrides


@pytest.fixture
def own_caches(monkeypatch):
    """Each rank makes its own cache, as on GPUs (no shared segment): rank 0 logs what
    it does to its cache outside a step, and the others do the same to theirs."""
    monkeypatch.setattr(parallel, "SHARE_HOST_CACHE", False)


def test_ranks_with_their_own_caches_zero_blocks_as_rank_zero_does(own_caches):
    # Preemption and chunked prefill: blocks zeroed again and again outside the steps.
    assert _same_tokens("tiny-random", 2, num_blocks=9, max_num_batched_tokens=16) > 0


def test_ranks_with_their_own_caches_swap_in_as_rank_zero_does(own_caches):
    # A swapped-in sequence that needed one more block at once: the queued copy shared
    # its list with the block table, which grew before the copy was sent, so rank 1
    # copied 7 host blocks into 8 and failed, and the worker with it.
    tok = build_tokenizer()
    base = tok.encode("shared system prompt, quite long indeed " * 2)
    prompts = [base + tok.encode(f" q{i} " * (1 + i)) for i in range(5)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    settings = dict(num_blocks=14, host_kv_cache_bytes=1 << 20, max_num_seqs=8)
    _same_tokens("tiny-random", 2, prompts, params, **settings)


def test_own_caches_are_not_transferable_and_say_so(own_caches):
    engine = make_engine("tiny-random", tensor_parallel_size=2, num_blocks=8)
    try:
        layout = engine.kv_fingerprint().kv_layout
        assert layout.endswith("; rank 0 of 2 only, not transferable")
        assert engine.kv.tensor.shape[0] == engine.model_config.num_layers  # rank 0's only
    finally:
        engine.close()


@pytest.mark.parametrize("variant", ["llama-attention-bias", "qwen2-qkv-bias"])
def test_tensor_parallel_with_biases_equals_one_device(tmp_path, variant):
    model_cls, config_cls, extra = VARIANTS[variant]
    tok = build_tokenizer()
    hf = model_cls(config_cls(vocab_size=len(tok), **{**COMMON, **extra})).eval()
    _peaked_random_(hf, seed=len(variant))
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    _same_tokens(str(tmp_path), 2)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-cache", "own-caches"])
def test_the_host_tier_on_two_ranks_swaps_and_serves_prefixes_for_every_rank(
    tiny_engine, monkeypatch, shared
):
    monkeypatch.setattr(parallel, "SHARE_HOST_CACHE", shared)
    # Rank 0 decides what goes to the tier and back; rank 1 makes the same copies of its
    # own heads (as in tests/engine/test_host_tier.py, on one device).
    tok, cfg = tiny_engine.tokenizer, tiny_engine.model_config
    rank_block = bytes_per_block(Shard(0, 2).config(cfg), 16, torch.float32)
    prompts = [tok.encode(t) for t in ("hello there", "a" * 40, "The quick brown fox " * 6,
                                       "x", "hi", "你好，世界")]  # fmt: skip
    shared = tok.encode("The quick brown fox jumps over the lazy dog " * 2)
    question = shared + tok.encode(" and then?")
    want = [tiny_engine.generate([p], GREEDY)[0] for p in [*prompts, question]]
    wide = make_engine(
        num_blocks=12,
        block_size=16,
        host_kv_cache_bytes=64 * rank_block,
        tensor_parallel_size=2,
    )
    try:
        # 12 blocks cannot hold six growing sequences: preempted ones are swapped.
        assert wide.generate(prompts, GREEDY) == want[:-1]
        host = wide.kv.host
        assert host.swaps_out > 0 and host.swaps_in == host.swaps_out
        wide.generate([shared], GREEDY)  # its blocks stay cached, then are reused
        wide.generate([tok.encode(f"{i} " * 60) for i in range(2)], GREEDY)
        assert wide.generate([question], GREEDY) == [want[-1]]
        assert host.prefix_hits > 0
        assert wide.kv.pool.num_used == 0 and host.held_blocks == 0
    finally:
        wide.close()


@pytest.mark.slow
def test_default_model_on_three_ranks_equals_one_device():
    # SmolLM2: 9 query heads and 3 KV heads, one KV head per rank.
    _same_tokens("smollm2-135m-instruct", 3, prompts=PROMPTS[:2])


def test_a_rank_that_dies_fails_the_next_step_and_is_reported():
    lost: list[str] = []
    config = EngineConfig(model="tiny-random", dtype="float32", tensor_parallel_size=2)
    engine = LLMEngine(config, on_rank_lost=lost.append)
    try:
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
        (pid,) = engine.tensor_parallel.pids
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost == ["tensor-parallel rank 1 exited with code -9"]
        # The group never meets again: its store is gone before the worker exits, which
        # it does by os._exit, with no close().
        assert not os.path.exists(engine.tensor_parallel._store_dir)
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            engine.step()
        engine.abort_all()
    finally:
        engine.close()


def test_a_rank_that_exits_after_ready_is_named_while_the_ranks_meet():
    # Rank 0 met the others through gloo, which waited for a dead one without limit (or
    # failed on a refused connection, naming no rank): a worker's start hung until its
    # launcher gave up.
    config = EngineConfig(model="tiny-random", dtype="float32", tensor_parallel_size=2)
    group = TensorParallel(config, num_blocks=8, host_blocks=0, device=torch.device("cpu"))
    (rank,) = group._procs
    select.select([rank.stdout], [], [], 120)  # its "ready" is waiting to be read
    rank.kill()
    rank.wait()
    started = time.monotonic()
    with pytest.raises(ConfigError, match="rank 1 exited with code -9 before the ranks met"):
        group.connect(timeout_s=60)
    assert time.monotonic() - started < 10


def test_one_lost_rank_is_one_report_naming_it_not_the_ranks_it_took_along():
    # A rank killed inside a step breaks the others' all-reduce, and they exit too: each
    # watcher reported its own rank, and the last (a bystander) was the reason kept.
    lost: list[str] = []
    config = EngineConfig(model="tiny-random", dtype="float32", tensor_parallel_size=4)
    engine = LLMEngine(config, on_rank_lost=lost.append)
    try:
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
        ranks = [psutil.Process(pid) for pid in engine.tensor_parallel.pids]
        ranks[1].suspend()  # rank 2 stops: the step waits for it
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
        stepping = threading.Thread(target=lambda: _step_quietly(engine), daemon=True)
        stepping.start()
        time.sleep(1.0)
        ranks[1].kill()
        stepping.join(30)
        assert survivors(ranks, within_s=15) == []
        time.sleep(0.5)  # any late watcher's report
        assert lost == ["tensor-parallel rank 2 exited with code -9"]
        engine.abort_all()
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match="rank 2 exited with code -9"):
            engine.step()
        engine.abort_all()
    finally:
        engine.close()


def _step_quietly(engine) -> None:
    try:
        engine.step()
    except Exception:  # the step the lost rank broke
        pass


def test_the_other_ranks_do_not_import_from_the_working_directory(tmp_path, monkeypatch):
    # ``python -m`` puts it first on sys.path: a file there named as a module the ranks
    # import replaced it in ranks 1..N-1 (rank 0, a console script, was unaffected).
    (tmp_path / "mmap.py").write_text(
        "raise ImportError('the working directory was on sys.path')\n"
    )
    monkeypatch.chdir(tmp_path)
    engine = make_engine(tensor_parallel_size=2)
    try:
        assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    finally:
        engine.close()


def test_a_rank_not_ready_in_time_is_named_and_every_rank_is_stopped():
    config = EngineConfig(model="tiny-random", dtype="float32", tensor_parallel_size=3)
    group = TensorParallel(config, num_blocks=8, host_blocks=0, device=torch.device("cpu"))
    ranks = [psutil.Process(pid) for pid in group.pids]
    with pytest.raises(ConfigError, match="tensor-parallel rank 1 was not ready within 0.01 s"):
        group.connect(timeout_s=0.01)  # loading takes longer than that
    assert survivors(ranks, within_s=15) == []


_SERVING = """
from tandem.engine.engine import LLMEngine
e = LLMEngine(EngineConfig(model="tiny-random", dtype="float32",
                           tensor_parallel_size=4, num_blocks=16))
pids = e.tensor_parallel.pids
"""
# Loaded, each waits to meet rank 0, which never comes (their store has no server that
# would die with rank 0: only the lifeline tells them).
_MEETING = """
import torch
from tandem.engine.parallel import TensorParallel
config = EngineConfig(model="tiny-random", dtype="float32", tensor_parallel_size=4)
group = TensorParallel(config, 8, 0, torch.device("cpu"))
for rank in group._procs:
    assert rank.stdout.readline().strip() == b"ready"
pids = group.pids
"""


@pytest.mark.parametrize("setup", [_SERVING, _MEETING], ids=["serving", "meeting"])
def test_the_other_ranks_die_with_rank_zero_however_it_ends(setup):
    script = "import time\nfrom tandem.config import EngineConfig\n" + setup
    script += "print(*pids, flush=True)\ntime.sleep(600)\n"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        ranks = [psutil.Process(int(p)) for p in proc.stdout.readline().split()]
        assert len(ranks) == 3
        ranks[0].suspend()  # a stopped rank runs no thread until the kernel continues it
        proc.kill()
        proc.wait()
        assert survivors(ranks, within_s=15) == []  # not after a 600 s timeout
    finally:
        proc.kill()


def test_a_failure_inside_a_step_ends_the_group_rather_than_leave_it_out_of_step():
    """Rank 0 raised after sending a step: the others wait in that step's all-reduces,
    which the next step's would pair with. The group stops and is reported lost."""
    lost: list[str] = []
    config = EngineConfig(model="tiny-random", dtype="float32", tensor_parallel_size=2)
    engine = LLMEngine(config, on_rank_lost=lost.append)
    try:
        ranks = [psutil.Process(pid) for pid in engine.tensor_parallel.pids]

        def broken(layer, done):
            raise OSError("the KV transport broke")

        engine.on_prefill_layer = broken
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), "p", prefill_only=True)
        with pytest.raises(OSError, match="transport broke"):
            engine.step()
        assert lost == [
            "tensor-parallel group broken: rank 0 failed inside a step "
            "(OSError('the KV transport broke'))"
        ]
        assert survivors(ranks, within_s=15) == []
        engine.abort_all()
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match="group broken"):
            engine.step()
        engine.abort_all()
    finally:
        engine.close()


def test_the_other_ranks_leave_signals_to_rank_zero_and_listen_on_loopback_only():
    """Ctrl-C or a service manager's SIGTERM reaches the whole process group: rank 0
    drains, and its other ranks must not die under it. They meet on loopback."""
    config = EngineConfig(model="tiny-random", dtype="float32", tensor_parallel_size=2)
    engine = LLMEngine(config)
    try:
        want = engine.generate(PROMPTS[:1], GREEDY)
        (pid,) = engine.tensor_parallel.pids
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(pid, sig)
        time.sleep(0.5)
        assert engine.tensor_parallel.lost is None
        assert engine.generate(PROMPTS[:1], GREEDY) == want
        listening = [
            c.laddr.ip
            for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert set(listening) <= {"127.0.0.1"}, listening
    finally:
        engine.close()


def test_int8_k_factors_are_the_same_at_every_width(tmp_path):
    # More ranks than KV heads: a rank holds part of its KV head's query group, and its
    # factors came from that part, so a cache written at one width was read at another
    # (a KV transfer, which the handshake allowed) with other factors: wrong tokens.
    import shutil

    from safetensors.torch import load_file, save_file

    from tandem.engine.engine import load_model, model_source
    from tandem.engine.loader import resolve_model

    shutil.copytree(resolve_model("tiny-random"), tmp_path, dirs_exist_ok=True)
    for f in tmp_path.glob("*.safetensors"):  # the two heads of a group look at other channels
        weights = load_file(f)
        for name, w in weights.items():
            if name.endswith("q_proj.weight"):
                w = w.clone().view(4, 16, -1)  # 4 query heads of 16 channels, 2 per group
                w[0::2, [0, 1, 8, 9]] *= 40
                w[1::2, [4, 5, 12, 13]] *= 40
                weights[name] = w.reshape(64, -1).contiguous()
        save_file(weights, f, metadata={"format": "pt"})
    config = EngineConfig(model=str(tmp_path), dtype="float32", kv_cache_dtype="int8")
    model_dir, cfg = model_source(config)
    cpu = torch.device("cpu")
    one = load_model(config, model_dir, cfg, cpu, torch.float32)
    assert any((layer.self_attn.k_balance != 1).any() for layer in one.layers)
    for rank in range(4):
        shard = Shard(rank, 4)
        wide = load_model(config, model_dir, cfg, cpu, torch.float32, shard)
        kv = shard.kv_heads(cfg)
        for a, b in zip(one.layers, wide.layers, strict=True):
            assert torch.equal(b.self_attn.k_balance, a.self_attn.k_balance[kv]), rank
