"""Greedy output through the engine is the same with every attention backend.

tiny-random in float32 on CPU, with a float and an int8 KV cache, the cpu
backend's kernel compiled here, the Triton kernels interpreted: mixed lengths in
one batch (decode and prefill in the same step), chunked prefill, and a
prefix-cache hit (prefill attention over cached blocks), each against the torch
backend.
"""

from __future__ import annotations

import pytest

from tandem.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.kernels.conftest import cpu_backend_or_skip, triton_backend_or_skip

# The interpreter runs each launch in Python (tens of ms): few tokens, still ~15 s in all.
pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(
    scope="module",
    params=[("cpu", "auto"), ("triton", "auto"), ("cpu", "int8"), ("triton", "int8")],
    ids=lambda p: "-".join(p),
)
def engines(request):
    backend, kv_cache_dtype = request.param
    {"cpu": cpu_backend_or_skip, "triton": triton_backend_or_skip}[backend]()
    # Small token budget: the long prompts are chunked, and decodes share steps with chunks.
    # An int8 cache: every backend stores the same bits and reads them the same way.
    options = {"max_num_batched_tokens": 24, "block_size": 4, "kv_cache_dtype": kv_cache_dtype}
    return make_engine(attention_backend="torch", **options), make_engine(
        attention_backend=backend, **options
    )


def _prompts(engine) -> list[list[int]]:
    texts = ["hello there", "你好，世界", "The quick brown fox jumps over the lazy dog " * 2, "x"]
    return [engine.tokenizer.encode(t) for t in texts]


def test_engine_greedy_output_is_the_same_with_either_backend(engines):
    torch_engine, other = engines
    assert torch_engine.attention_backend == "torch" and other.attention_backend != "torch"
    prompts = _prompts(torch_engine)

    expected = torch_engine.generate(prompts, GREEDY)
    got = other.generate(prompts, GREEDY)

    assert got == expected
    for engine in engines:
        engine.kv.pool.check_integrity()
        assert engine.kv.pool.num_used == 0


def test_prefix_cache_hit_gives_the_same_tokens(engines):
    torch_engine, _ = engines
    base = _prompts(torch_engine)[2]
    longer = base + torch_engine.tokenizer.encode(" and back again")

    results = []
    for engine in engines:
        engine.generate([base], GREEDY)  # computes and hashes base's full blocks
        hits = engine.kv.prefix_hit_tokens
        results.append(engine.generate([longer], GREEDY)[0])
        assert engine.kv.prefix_hit_tokens - hits >= len(base) // 4 * 4 - 4

    assert results[1] == results[0]
