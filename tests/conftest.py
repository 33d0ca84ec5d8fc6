"""Shared fixtures: engines are expensive, so each model is loaded once per session."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.engine import LLMEngine


def make_engine(model: str = "tiny-random", **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype="float32", device="cpu", **overrides))


@pytest.fixture(scope="session")
def tiny_engine() -> LLMEngine:
    return make_engine("tiny-random")


@pytest.fixture(scope="session")
def tiny_hf(tiny_engine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_engine.model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_engine() -> LLMEngine:
    return make_engine("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smol_hf(smol_engine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_engine.model_dir, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def _engines_leak_nothing(request):
    """Every test that used an engine must leave its pool intact and empty."""
    yield
    for name in ("tiny_engine", "smol_engine"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name)
            assert not engine.has_unfinished(), "a request was left running"
            engine.kv.pool.check_integrity()
            assert engine.kv.pool.num_used == 0, f"{engine.kv.pool.num_used} KV blocks leaked"
