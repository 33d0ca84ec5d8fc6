"""Colocated engine behaviour on tiny-random: batching, chunking, preemption, stops, errors."""

from __future__ import annotations

import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import FinishReason
from tandem.errors import InvalidRequestError
from tests.conftest import make_engine
from tests.parity import assert_parity, hf_greedy

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(engine, n: int = 5) -> list[list[int]]:
    texts = ["hello there", "你好，世界", "a" * 40, "The quick brown fox " * 6, "x"]
    return [engine.tokenizer.encode(t) for t in (texts * n)[:n]]


def test_results_do_not_depend_on_the_batch(tiny_engine):
    prompts = _prompts(tiny_engine)
    alone = [tiny_engine.generate([p], GREEDY)[0] for p in prompts]
    together = tiny_engine.generate(prompts, GREEDY)
    reversed_ = tiny_engine.generate(prompts[::-1], GREEDY)[::-1]
    assert together == alone
    assert reversed_ == alone


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_engine):
    prompts = _prompts(tiny_engine)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = tiny_engine.generate([prompts[0]], seeded)[0]
    others = [SamplingParams(max_tokens=16, temperature=0.8, seed=i) for i in range(4)]
    together = tiny_engine.generate(prompts, [seeded, *others])[0]
    again = tiny_engine.generate([prompts[0]], seeded)[0]
    assert alone == together == again
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert tiny_engine.generate([prompts[0]], other_seed)[0] != alone


def test_chunked_prefill_matches_hf(tiny_hf):
    engine = make_engine(max_num_batched_tokens=7)  # every prompt spans several steps
    prompts = _prompts(engine)
    params = SamplingParams(max_tokens=12, temperature=0)
    outs = engine.generate(prompts, params)
    for p, o in zip(prompts, outs, strict=True):
        assert_parity(tiny_hf, p, o, hf_greedy(tiny_hf, p, 12, engine.eos_token_ids))
    assert engine.kv.pool.num_used == 0


def test_preemption_under_a_small_pool_gives_the_same_tokens(tiny_engine):
    prompts = _prompts(tiny_engine, 6)
    expected = [tiny_engine.generate([p], GREEDY)[0] for p in prompts]
    # 12 blocks of 16 tokens cannot hold six growing sequences at once.
    engine = make_engine(num_blocks=12, block_size=16)
    preempted = []
    original = engine.scheduler._preempt

    def spy(seq):
        preempted.append(seq.request_id)
        original(seq)

    engine.scheduler._preempt = spy
    assert engine.generate(prompts, GREEDY) == expected
    assert preempted, "the scenario must actually preempt"
    engine.kv.pool.check_integrity()
    assert engine.kv.pool.num_used == 0


def test_prefix_cache_hit_gives_the_same_tokens(tiny_engine):
    prompt = tiny_engine.tokenizer.encode("shared system prompt " * 8)
    first = tiny_engine.generate([prompt], GREEDY)[0]
    hits_before = tiny_engine.kv.prefix_hit_tokens
    second = tiny_engine.generate([prompt], GREEDY)[0]
    assert tiny_engine.kv.prefix_hit_tokens - hits_before == (len(prompt) - 1) // 16 * 16
    assert second == first
    no_cache = make_engine(enable_prefix_caching=False)
    assert no_cache.generate([prompt], GREEDY)[0] == first


def test_a_cache_salt_shares_cached_prefixes_only_with_its_own_salt(tiny_engine):
    # A router gives each API key its salt: another key's prompt is never a hit.
    prompt = tiny_engine.tokenizer.encode("a system prompt for one key only " * 6)

    def run(salt: str) -> tuple[int, list[int]]:
        hits = tiny_engine.kv.prefix_hit_tokens
        rid = tiny_engine.add_request(prompt, GREEDY, cache_salt=salt)
        tokens = []
        while tiny_engine.has_unfinished():
            tokens += [t for o in tiny_engine.step() if o.request_id == rid for t in o.token_ids]
        return tiny_engine.kv.prefix_hit_tokens - hits, tokens

    first_hits, first = run("alice")
    assert first_hits == 0
    assert run("alice") == ((len(prompt) - 1) // 16 * 16, first)
    assert run("bob") == (0, first)
    assert run("")[1] == first
    tiny_engine.kv.pool.check_integrity()


def test_stream_text_concatenates_to_the_decoded_output(tiny_engine):
    prompt = tiny_engine.tokenizer.encode("héllo 你好 🎉")
    outs = list(tiny_engine.stream(prompt, GREEDY))
    ids = [t for o in outs for t in o.token_ids]
    text = "".join(o.text for o in outs)
    # A random model emits arbitrary bytes, so U+FFFD can be in the text legitimately;
    # clean streaming of valid UTF-8 is tested in test_tokenizer.py.
    assert text == tiny_engine.tokenizer.decode(ids)
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert [o.finished for o in outs[:-1]] == [False] * (len(outs) - 1)
    assert outs[-1].num_output_tokens == GREEDY.max_tokens


def test_stop_string_ends_the_request_and_is_not_emitted(tiny_engine):
    prompt = tiny_engine.tokenizer.encode("stop test")
    full = "".join(o.text for o in tiny_engine.stream(prompt, GREEDY))
    stop = full[5:8]
    assert stop and stop not in full[:5]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,))
    outs = list(tiny_engine.stream(prompt, params))
    assert "".join(o.text for o in outs) == full[: full.index(stop)]
    assert outs[-1].finish_reason is FinishReason.STOP


def test_stop_token_and_eos(tiny_engine):
    prompt = tiny_engine.tokenizer.encode("stop test")
    ids = tiny_engine.generate([prompt], GREEDY)[0]
    target = ids[3]
    params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(target,))
    outs = list(tiny_engine.stream(prompt, params))
    got = [t for o in outs for t in o.token_ids]
    assert got == ids[: ids.index(target) + 1]
    assert outs[-1].finish_reason is FinishReason.STOP


def test_abort_mid_stream_frees_blocks(tiny_engine):
    prompt = tiny_engine.tokenizer.encode("abort me " * 10)
    stream = tiny_engine.stream(prompt, GREEDY)
    next(stream)
    next(stream)
    assert tiny_engine.kv.pool.num_used > 0
    stream.close()  # the consumer went away: the request is aborted
    assert tiny_engine.kv.pool.num_used == 0
    assert not tiny_engine.has_unfinished()


@pytest.mark.parametrize(
    "prompt, params, field, words",
    [
        ([], GREEDY, "prompt", "must not be empty"),
        (
            [5] * 10,
            SamplingParams(max_tokens=5000),
            "max_tokens",
            "exceeds the context length 4096",
        ),
        ([10**6], GREEDY, "prompt", "outside [0, 259)"),
    ],
)
def test_bad_requests_are_refused_before_any_block(tiny_engine, prompt, params, field, words):
    with pytest.raises(InvalidRequestError) as err:
        tiny_engine.add_request(prompt, params)
    assert err.value.field == field and words in str(err.value)
    assert tiny_engine.kv.pool.num_used == 0 and not tiny_engine.has_unfinished()


def test_request_larger_than_the_pool_is_refused():
    engine = make_engine(num_blocks=4, block_size=16)
    with pytest.raises(InvalidRequestError, match="needs 5 KV blocks, the pool has 4"):
        engine.add_request([7] * 60, SamplingParams(max_tokens=10))


def test_a_kv_budget_that_holds_no_block_is_refused_not_rounded_up():
    # It was rounded up to one block: block_size 2**20 took 48 GB for 512 MiB allowed.
    from tandem.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^kv_cache_bytes 1000 holds no KV block of \d+ bytes "
                                          r"\(block_size 16, kv_cache_dtype auto\)"):  # fmt: skip
        make_engine(kv_cache_bytes=1000)


def test_an_int8_kv_cache_holds_its_scales_and_more_blocks_in_the_same_bytes():
    import torch

    from tandem.engine.kv_cache import bytes_per_block

    budget = 4 * 2**20
    float_engine = make_engine(kv_cache_bytes=budget)
    engine = make_engine(kv_cache_bytes=budget, kv_cache_dtype="int8")
    cfg, bs = engine.model_config, engine.kv.block_size
    assert engine.kv.tensor.dtype == torch.int8
    assert engine.kv.tensor.shape[-1] == cfg.head_dim + 2  # values, then a float16 scale
    per_block = bytes_per_block(cfg, bs, torch.int8)
    assert per_block == engine.kv.tensor[:, :, 0].numel()
    assert engine.kv.pool.num_blocks == budget // per_block
    ratio = engine.kv.pool.num_blocks / float_engine.kv.pool.num_blocks
    assert ratio == pytest.approx(4 * cfg.head_dim / (cfg.head_dim + 2), rel=0.01)  # float32
    assert engine.kv_fingerprint().kv_cache_dtype == "int8"
    assert float_engine.kv_fingerprint().kv_cache_dtype == "auto"


def test_an_int8_cache_prefill_attends_its_own_tokens_exactly_and_earlier_chunks_as_stored():
    """Within a prefill chunk, attention takes the chunk's K/V as computed, so one
    chunk scores as with a float cache (up to the rotation's rounding); a later chunk
    reads the earlier one from the int8 cache."""
    ids = list(range(3, 3 + 40))
    exact = make_engine().score(ids, chunk_tokens=64)
    engine = make_engine(kv_cache_dtype="int8")

    one_chunk = engine.score(ids, chunk_tokens=64)
    chunked = engine.score(ids, chunk_tokens=16)

    assert max(abs(a - b) for a, b in zip(one_chunk, exact, strict=True)) < 1e-4
    # The first chunk is the same computation as the first 16 tokens of one chunk.
    assert max(abs(a - b) for a, b in zip(chunked[:16], one_chunk[:16], strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(chunked[15:], exact[15:], strict=True)) > 1e-4
    assert engine.kv.pool.num_used == 0


def test_preemption_with_an_int8_kv_cache_gives_the_same_tokens():
    # Recompute after preemption quantizes the same rows again: the same tokens.
    reference = make_engine(kv_cache_dtype="int8")
    prompts = _prompts(reference, 6)
    expected = [reference.generate([p], GREEDY)[0] for p in prompts]
    engine = make_engine(num_blocks=12, block_size=16, kv_cache_dtype="int8")
    assert engine.generate(prompts, GREEDY) == expected
    assert engine.stats.preemptions > 0
    engine.kv.pool.check_integrity()
    assert engine.kv.pool.num_used == 0
