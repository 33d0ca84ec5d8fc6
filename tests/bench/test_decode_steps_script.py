"""bench/decode_steps.py: its variants turn one path off and put it back, and a run
on the tiny model times every variant."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
