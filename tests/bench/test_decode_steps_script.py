"""bench/decode_steps.py: its variants turn one path off and put it back, and a run
on the tiny model times every variant."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import model as model_module
from tandem.engine.engine import LLMEngine
from tests.bench import scripts


@pytest.fixture(scope="module")
def decode_steps():
    yield scripts.load("decode_steps")
    scripts.unload("decode_steps")


def test_each_variant_turns_its_path_off_and_back_on(decode_steps):
    engine = LLMEngine(EngineConfig(model="tiny-random", dtype="bfloat16", num_blocks=16))
    variants = decode_steps._variants(engine)
    assert "no-amx" not in variants and "no-head-codes" not in variants  # no GGUF codes
    norm = model_module.cpu_norm
    x = engine.model.norm.weight[None, :]
    if norm.rms_norm(x, engine.model.norm.weight, 1e-5) is None:
        assert list(variants) == ["all"]  # the C kernels do not build on this machine
        return
    fused = norm.rms_norm
    with variants["no-fused-norm"]():
        assert norm.rms_norm(x, engine.model.norm.weight, 1e-5) is None
    assert norm.rms_norm is fused
    ops, rows = model_module.cpu_ops, x.float()
    with variants["no-step-ops"]():
        assert ops.argmax(rows) is None and ops.rope(x[None], x, x) is None
    assert ops.argmax(rows) == [int(rows.argmax())]


def test_the_float32_codes_variant_sets_them_aside_and_back(decode_steps):
    from tandem.engine import gguf_int4

    engine = LLMEngine(EngineConfig(model="tiny-random", dtype="float32", num_blocks=16))
    down = engine.model.layers[0].mlp.down_proj
    rows, cols = down.out_features, down.in_features
    codes = gguf_int4.Q4_1(
        torch.zeros(rows, cols, dtype=torch.uint8),
        torch.ones(rows, cols // gguf_int4.GROUP),
        torch.zeros(rows, cols // gguf_int4.GROUP),
    )
    forms = gguf_int4.pack(codes, torch.float32)
    down.use_int4(forms, 64)
    variants = decode_steps._variants(engine)
    assert "no-head-codes" not in variants  # float32 codes are set aside together
    with variants["no-f32-codes"]():
        assert down.int4 is None
    assert down.int4 is forms


def test_a_run_times_every_variant_at_every_batch():
    result = subprocess.run(
        [sys.executable, str(scripts.BENCH / "decode_steps.py"), "--model", "tiny-random",
         "--batches", "1,3", "--prompt-len", "8", "--steps", "3", "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    steps = json.loads(result.stdout)["step_ms"]
    assert set(steps) == {"1", "3"}
    assert all("all" in by and all(ms > 0 for ms in by.values()) for by in steps.values())
