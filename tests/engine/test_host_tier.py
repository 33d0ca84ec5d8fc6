"""The host-memory KV tier: prefix blocks evicted from the cache come back from it, and
a preempted sequence is swapped out and in instead of recomputed; the tokens are the
same as without the tier, and no block stays held on either side."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging

import pytest
import torch

from tandem.engine import host_tier
from tandem.engine.host_tier import HostTier
from tandem.engine.kv_cache import bytes_per_block
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import FinishReason
from tests.conftest import make_engine

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
BLOCK = 4


def _tiered(tiny_engine, num_blocks: int, host_blocks: int, **overrides):
    per_block = bytes_per_block(tiny_engine.model_config, BLOCK, tiny_engine.dtype)
    return make_engine(
        num_blocks=num_blocks,
        block_size=BLOCK,
        host_kv_cache_bytes=host_blocks * per_block,
        **overrides,
    )


def _no_leaks(engine) -> None:
    engine.kv.pool.check_integrity()
    assert engine.kv.pool.num_used == 0
    if engine.kv.host is not None:
        engine.kv.host.check_integrity()
        assert engine.kv.host.held_blocks == 0


def _computed_tokens(engine) -> list[int]:
    """Counts every token the model computes from now on (prompt chunks and decodes)."""
    counted = [0]
    run = engine.runner.run

    def counting(work, *args, **kwargs):
        counted[0] += sum(n for _, n in work)
        return run(work, *args, **kwargs)

    engine.runner.run = counting
    return counted


def test_an_evicted_prefix_is_served_from_the_host_tier(tiny_engine):
    shared = tiny_engine.tokenizer.encode("The quick brown fox jumps")
    question = shared + tiny_engine.tokenizer.encode(" and then?")
    expected = tiny_engine.generate([question], GREEDY)[0]
    engine = _tiered(tiny_engine, num_blocks=24, host_blocks=32)

    engine.generate([shared], GREEDY)  # its full blocks stay cached when it ends
    assert engine.kv.host.prefix_hits == 0
    # Other prompts take every block: the cached prefix blocks are reused, and saved.
    others = [tiny_engine.tokenizer.encode(f"{i} " * 20) for i in range(3)]
    for other in others:
        engine.generate([other], GREEDY)
    hits_before = engine.kv.prefix_hit_tokens

    got = engine.generate([question], GREEDY)[0]

    assert got == expected
    served = engine.kv.host.prefix_hits
    assert served >= (len(shared) - 1) // BLOCK - 1  # all but what the device still held
    assert engine.kv.prefix_hit_tokens - hits_before >= served * BLOCK
    _no_leaks(engine)


def test_preemption_swaps_out_and_in_with_the_same_tokens_and_no_recompute(tiny_engine):
    texts = ("hello there", "你好，世界", "a" * 40, "The quick brown fox " * 6, "x", "hi")
    prompts = [tiny_engine.tokenizer.encode(t) for t in texts]
    expected = [tiny_engine.generate([p], GREEDY)[0] for p in prompts]
    # 12 blocks of 16 tokens cannot hold six growing sequences at once (as in
    # test_engine.py's preemption test); the tier can hold every preempted one.
    per_block = bytes_per_block(tiny_engine.model_config, 16, tiny_engine.dtype)
    recompute = make_engine(num_blocks=12, block_size=16)
    swap = make_engine(num_blocks=12, block_size=16, host_kv_cache_bytes=64 * per_block)
    counts = [_computed_tokens(recompute), _computed_tokens(swap)]

    assert recompute.generate(prompts, GREEDY) == expected
    assert swap.generate(prompts, GREEDY) == expected

    assert recompute.stats.preemptions > 0 and swap.stats.preemptions > 0
    host = swap.kv.host
    assert host.swaps_out == swap.stats.preemptions and host.swaps_in == host.swaps_out
    exact = sum(len(p) for p in prompts) + len(prompts) * (GREEDY.max_tokens - 1)
    assert counts[1][0] == exact  # nothing computed twice
    assert counts[0][0] > exact  # recompute did
    _no_leaks(swap)
    _no_leaks(recompute)


def test_a_swapped_request_that_is_aborted_frees_its_host_blocks(tiny_engine):
    engine = _tiered(tiny_engine, num_blocks=8, host_blocks=16)
    long = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    first = engine.add_request(tiny_engine.tokenizer.encode("a" * 10), long)
    second = engine.add_request(tiny_engine.tokenizer.encode("b" * 10), long)
    while engine.kv.host.held_blocks == 0:
        assert engine.has_unfinished(), "the scenario must swap a sequence out"
        engine.step()
    swapped = next(r for r in (first, second) if engine._requests[r].seq.host_blocks)

    engine.abort(swapped)

    assert engine.kv.host.held_blocks == 0
    while engine.has_unfinished():
        engine.step()
    _no_leaks(engine)


def test_without_room_in_the_tier_preemption_recomputes(tiny_engine):
    engine = _tiered(tiny_engine, num_blocks=8, host_blocks=1)
    prompts = [tiny_engine.tokenizer.encode(t) for t in ("a" * 10, "b" * 10)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = [tiny_engine.generate([p], params)[0] for p in prompts]
    assert engine.generate(prompts, params) == expected
    assert engine.stats.preemptions > 0 and engine.kv.host.swaps_out == 0
    _no_leaks(engine)


def test_a_negative_host_tier_is_refused_by_name():
    from tandem.config import EngineConfig
    from tandem.errors import ConfigError

    with pytest.raises(ConfigError, match="host_kv_cache_bytes must be >= 0"):
        EngineConfig(host_kv_cache_bytes=-1)


def test_a_host_tier_too_small_for_one_block_is_refused_by_name():
    from tandem.errors import ConfigError

    with pytest.raises(ConfigError, match="host_kv_cache_bytes 100 holds no KV block of"):
        make_engine(host_kv_cache_bytes=100)


def test_swapping_keeps_an_int8_windowed_sequence_exactly(tiny_engine):
    # A swapped sequence keeps its quantized blocks, its window and what the window
    # freed: the tokens of an unpreempted run with the same settings.
    settings = dict(
        block_size=BLOCK, kv_cache_dtype="int8", kv_window_tokens=8, max_num_batched_tokens=8
    )
    texts = ("a" * 10, "b" * 12, "c" * 9)
    prompts = [tiny_engine.tokenizer.encode(t) for t in texts]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    reference = make_engine(**settings)
    expected = [reference.generate([p], params)[0] for p in prompts]
    per_block = bytes_per_block(tiny_engine.model_config, BLOCK, reference.kv_dtype)
    engine = make_engine(num_blocks=10, host_kv_cache_bytes=32 * per_block, **settings)

    assert engine.generate(prompts, params) == expected

    assert engine.kv.host.swaps_in > 0 and engine.kv.window_evicted_blocks > 0
    _no_leaks(engine)


def test_each_host_block_is_one_contiguous_run_of_every_layers_rows():
    # A block moves between a CUDA cache and the tier as one DMA only where its host
    # side is contiguous: with the cache's layout, a block was 2 x layers runs.
    cache = torch.randn(3, 2, 6, BLOCK, 2, 8)  # [layers, K/V, blocks + 1, block, heads, dim]
    tier = HostTier(cache, num_blocks=4)
    assert all(tier.tensor[h].is_contiguous() for h in range(4))
    host = tier.swap_out(cache, [4, 1])
    assert torch.equal(tier.tensor[host[0]], cache[:, :, 4])
    other = torch.zeros_like(cache)
    tier.swap_in(host, other, [0, 2])
    assert torch.equal(other[:, :, 0], cache[:, :, 4])
    assert torch.equal(other[:, :, 2], cache[:, :, 1])


class _FakeDriver:
    """libcuda's two calls (functions take the argtypes that ctypes' do)."""

    def __init__(self, status: int = 0) -> None:
        self.registered: dict[int, int] = {}

        def register(ptr: int, size: int, flags: int) -> int:
            assert flags == 1  # portable: locked for every device's context
            if status == 0:
                self.registered[ptr] = size
            return status

        def unregister(ptr: int) -> int:
            del self.registered[ptr]
            return 0

        self.cuMemHostRegister_v2, self.cuMemHostUnregister = register, unregister


class _CudaCache:
    """What HostTier reads of a CUDA cache, on a machine without one."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape, self.dtype, self.is_cuda, self.device = shape, torch.bfloat16, True, "cuda:1"


def test_a_gpu_host_tier_is_page_locked_at_its_exact_size_while_it_lives(monkeypatch):
    # torch.zeros(pin_memory=True) rounds up to a power of two: a 40 GiB tier locked 64.
    driver = _FakeDriver()
    monkeypatch.setattr(host_tier, "_driver", lambda: driver)
    devices = []
    monkeypatch.setattr(
        torch.cuda, "device", lambda d: devices.append(d) or contextlib.nullcontext()
    )
    tier = HostTier(_CudaCache((3, 2, 11, BLOCK, 2, 8)), num_blocks=5)
    assert driver.registered == {tier.tensor.data_ptr(): 5 * 3 * 2 * BLOCK * 2 * 8 * 2}
    assert devices == ["cuda:1"]  # registered in the cache's device's context
    del tier
    gc.collect()
    assert driver.registered == {}


def test_a_host_tier_the_driver_will_not_lock_stays_pageable(monkeypatch, caplog):
    driver = _FakeDriver(status=2)  # CUDA_ERROR_OUT_OF_MEMORY
    monkeypatch.setattr(host_tier, "_driver", lambda: driver)
    with caplog.at_level(logging.WARNING, logger="tandem.engine.host_tier"):
        host_tier._page_lock(HostTier.__new__(HostTier), torch.zeros(10))
    assert "page-locking its 40 bytes failed (cuMemHostRegister: 2)" in caplog.text
    assert driver.registered == {}


def test_a_host_tier_without_a_driver_library_stays_pageable(monkeypatch, caplog):
    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(host_tier, "_driver", missing)
    with caplog.at_level(logging.WARNING, logger="tandem.engine.host_tier"):
        host_tier._page_lock(HostTier.__new__(HostTier), torch.zeros(10))
    assert "(cuMemHostRegister: OSError: libcuda.so.1: cannot open" in caplog.text


@pytest.mark.parametrize("copy", ["copy_out", "copy_in"])
def test_a_swap_whose_copy_fails_fails_the_step_and_leaves_nothing_behind(tiny_engine, copy):
    # A failed copy out took the sequence off the running list first: the failed
    # step's clean-up could not find it, raised, and the engine thread died with every
    # stream on it. A failed copy in kept the blocks it had allocated.
    from tandem.engine.loop import EngineLoop

    engine = _tiered(tiny_engine, num_blocks=6, host_blocks=20)  # 3 x 5 blocks: preemption
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    host = engine.kv.host
    real = getattr(host, copy)

    def fails(*args, **kwargs):
        raise RuntimeError(f"injected: {copy} failed")

    setattr(host, copy, fails)
    loop = EngineLoop(engine)
    loop.start()

    async def run(rid: str) -> FinishReason:
        q = loop.subscribe(rid)
        await loop.call(lambda e: e.add_request(list(range(3, 10)), params, rid))
        out = await asyncio.wait_for(q.get(), 30)
        while not out.finished:
            out = await asyncio.wait_for(q.get(), 30)
        return out.finish_reason

    async def three() -> list[FinishReason]:
        return await asyncio.gather(*(run(f"r{i}") for i in range(3)))

    try:
        assert FinishReason.ERROR in asyncio.run(three())
        setattr(host, copy, real)
        assert asyncio.run(run("after")) is FinishReason.LENGTH  # the engine went on
        loop.submit(_no_leaks).result(10)
    finally:
        loop.stop()


@pytest.mark.parametrize("copy", ["copy_out", "copy_in"])
def test_a_prefix_copy_to_or_from_the_tier_that_fails_changes_nothing(tiny_engine, copy):
    # The swap path changes nothing when its copy raises; the prefix path did not. A
    # failed copy of an evicted prefix block lost it and the blocks allocated with it
    # (free 1 + used 2 of 4), and its hash still named it: the next request with that
    # prefix failed on it every time, and one needing every block waited for ever. A
    # failed copy back in kept a device and a host block.
    engine = _tiered(tiny_engine, num_blocks=4, host_blocks=8)
    first, second = list(range(10, 19)), list(range(100, 115))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def run(prompt: list[int]) -> None:
        engine.add_request(prompt, one)
        for _ in range(100):
            if not engine.has_unfinished():
                return
            try:
                engine.step()
            except RuntimeError:
                engine.abort_failed_step()  # what the engine loop does after a failed step
        raise AssertionError("a request waited for ever")

    run(first)
    if copy == "copy_in":
        run(second)  # the first prompt's cached blocks go to the tier
    host = engine.kv.host
    real = getattr(host, copy)

    def fails(*args, **kwargs):
        raise RuntimeError(f"injected: {copy} failed")

    setattr(host, copy, fails)
    run(second if copy == "copy_out" else first)  # evicts, or brings back: fails
    setattr(host, copy, real)
    _no_leaks(engine)
    run(first)  # the same prefix again, and a request that needs every block
    run(second)
    _no_leaks(engine)


@pytest.mark.parametrize("method", ["prefill_here", "reserve_for_transfer"])
def test_a_prefix_copy_back_that_fails_in_a_decode_workers_reservation_keeps_nothing(
    tiny_engine, method
):
    # The lookup shared a cached device block, then brought the next block back from
    # the tier, and that copy failed: the shared block stayed referenced by a sequence
    # no one had registered, so nothing ever freed it.
    engine = _tiered(tiny_engine, num_blocks=4, host_blocks=8)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    first = list(range(10, 19))  # two full blocks and a token
    for prompt in (first, list(range(100, 109))):  # the second evicts first's tail
        engine.add_request(prompt, one)
        while engine.has_unfinished():
            engine.step()
    host = engine.kv.host

    def fails(*args, **kwargs):
        raise RuntimeError("injected: copy_in failed")

    real, host.copy_in = host.copy_in, fails
    with pytest.raises(RuntimeError, match="injected"):
        getattr(engine, method)(first + [1, 2], one, "r")
    host.copy_in = real
    assert not engine.has_unfinished()
    _no_leaks(engine)
