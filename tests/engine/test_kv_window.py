"""Attention sinks + a sliding KV window: constant memory past the pool, and the
tokens Hugging Face gives when each position attends to what the window kept.

The window keeps the first ``kv_sink_tokens`` (whole blocks) and at least the last
``kv_window_tokens`` (whole blocks) of each sequence. The reference is the HF model
on the whole text with a 4-D attention mask whose row p holds exactly the positions
the engine kept when it computed position p, so that every K and V the engine read
was computed, in HF, under the same mask.
"""

from __future__ import annotations

import pytest
import torch

from tandem.engine.sampling_params import SamplingParams
from tandem.errors import InvalidRequestError
from tests.conftest import make_engine

BLOCK, SINKS, WINDOW = 4, 4, 8


def _window_engine(**overrides):
    options = dict(block_size=BLOCK, kv_sink_tokens=SINKS, kv_window_tokens=WINDOW)
    return make_engine(**{**options, **overrides})


def _kept(positions: int, computed_before: int) -> list[int]:
    """The positions a token at ``positions`` attends to, the engine's window having
    slid after ``computed_before`` tokens: the sink blocks, then whole blocks from the
    first one that leaves at least WINDOW tokens after it."""
    sink_end = -(-SINKS // BLOCK) * BLOCK
    evicted = 0
    while computed_before - evicted * BLOCK - sink_end - BLOCK >= WINDOW:
        evicted += 1
    start = sink_end + evicted * BLOCK
    return list(range(min(sink_end, positions + 1))) + list(range(max(start, sink_end),
                                                                   positions + 1))  # fmt: skip


def _hf_windowed_greedy(hf, prompt: list[int], steps: int, chunk: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        n = len(ids)
        mask = torch.full((1, 1, n, n), float("-inf"))
        for p in range(n):
            # A prompt row was computed in its chunk, over what the window kept before
            # the chunk and the chunk's tokens up to it; a generated token's row alone.
            computed_before = p // chunk * chunk if p < len(prompt) else p
            mask[0, 0, p, _kept(p, computed_before)] = 0.0
        with torch.no_grad():
            logits = hf(torch.tensor([ids]), attention_mask=mask).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    ("text", "chunk"),
    [("hello there", 1024), ("The quick brown fox jumps over the lazy dog", 8)],
    ids=["short-prompt", "prompt-in-chunks-past-the-window"],
)
def test_windowed_decoding_matches_hf_under_the_same_mask(tiny_engine, tiny_hf, text, chunk):
    prompt = tiny_engine.tokenizer.encode(text)
    engine = _window_engine(num_blocks=32, max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    got = engine.generate([prompt], params)[0]

    assert got == _hf_windowed_greedy(tiny_hf, prompt, 40, chunk)
    assert got != tiny_engine.generate([prompt], params)[0]  # the window changed something
    assert engine.kv.window_evicted_blocks > 0
    engine.kv.pool.check_integrity()
    assert engine.kv.pool.num_used == 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_sequence_runs_past_the_pool_in_constant_memory(tiny_engine, kv_cache_dtype):
    # 8 blocks of 4 tokens hold 32 tokens; the request asks for 300, in chunks of 16.
    engine = _window_engine(num_blocks=8, max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
    prompt = tiny_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog " * 3)
    assert len(prompt) > 2 * (SINKS + WINDOW)  # the prompt itself slides while prefilled
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    seq = engine._requests[rid].seq
    used, tokens = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.token_ids)
        used.append(engine.kv.pool.num_used)
        # The spec: the sink block, then at least WINDOW and fewer than WINDOW + BLOCK
        # computed tokens, once the sequence is past them.
        window = engine.kv.table_index(seq, seq.num_computed) - BLOCK
        if seq.num_computed >= BLOCK + WINDOW + BLOCK and not seq.finished:
            assert WINDOW <= window < WINDOW + BLOCK, (seq.num_computed, window)

    assert tokens == 300
    # Sinks (1 block) + the window (at most 3 blocks) + the block being filled, and a
    # prefill chunk's blocks while the prompt runs.
    decode_steps = used[-250:-1]  # the last step finished the request: nothing held
    assert max(decode_steps) <= 1 + 3 + 1
    assert min(decode_steps) >= 1 + 2
    assert max(used) <= engine.kv.max_blocks_per_sequence(len(prompt) + 300, 16) <= 8
    assert engine.kv.pool.num_used == 0 and rid


def test_without_a_window_the_same_request_is_refused_by_name(tiny_engine):
    engine = make_engine(block_size=BLOCK, num_blocks=8, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    needs = "= 311 tokens needs 78 KV blocks, the pool has 8"
    with pytest.raises(InvalidRequestError, match=needs):
        engine.validate(tiny_engine.tokenizer.encode("hello there"), params)


def test_scoring_through_the_window_differs_only_past_it(tiny_engine):
    text = tiny_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog " * 4)
    full = make_engine(block_size=BLOCK).score(text, chunk_tokens=1)
    windowed = _window_engine(num_blocks=16).score(text, chunk_tokens=1)
    # Until the first block leaves, the window holds everything.
    first_slide = -(-SINKS // BLOCK) * BLOCK + WINDOW + BLOCK
    assert windowed[: first_slide - 1] == pytest.approx(full[: first_slide - 1], abs=1e-5)
    assert windowed != pytest.approx(full, abs=1e-5)


def test_kv_held_whole_that_cannot_fit_is_refused_by_name(tiny_engine):
    # A prefill worker ships a prompt's KV whole, and a decode worker reserves it whole:
    # the window applies only after, so such a prompt must fit the pool.
    engine = _window_engine(num_blocks=8, max_num_batched_tokens=8)
    prompt = tiny_engine.tokenizer.encode("a" * 40)  # 10 blocks of 4
    params = SamplingParams(max_tokens=4, temperature=0)
    engine.validate(prompt, params)  # colocated, the window bounds it
    with pytest.raises(InvalidRequestError, match="ships the KV of 40 tokens whole: 10 KV"):
        engine.add_request(prompt, params, "p", prefill_only=True)
    with pytest.raises(InvalidRequestError, match="reserves the KV of 41 tokens whole: 11 KV"):
        engine.reserve(prompt, params, "d")
    # Exactly the pool, and the next token's slot beyond: refused, not "full" for ever.
    with pytest.raises(InvalidRequestError, match="reserves the KV of 33 tokens whole: 9 KV"):
        engine.reserve(prompt[:32], params, "d")
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished()
    # Prefilled where it decodes, it is computed in segments under the window: no
    # whole to hold (a request moved off a lost worker, whose stream ran past the pool).
    engine.prefill_here(prompt, params, "h")
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.pool.num_used == 0


def test_a_windowed_reservation_holds_what_the_window_holds_not_the_output_ahead(tiny_engine):
    # A prompt that fits the pool whole, and reserve_output_tokens more that do not: the
    # output to come is grown into under the window, and was refused as "whole".
    engine = _window_engine(num_blocks=16, reserve_output_tokens=128)
    prompt = [7] * 40  # 10 blocks of 4 in 16
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    blocks = engine.reserve(prompt, params, "d")
    assert len(blocks) <= 16
    engine.abort("d")
    assert engine.kv.pool.num_used == 0


def test_the_window_bound_counts_a_short_prompts_chunk_not_the_whole_step_budget():
    # A 20-token prompt is computed in one chunk of 20, not of max_num_batched_tokens:
    # with the default budget such a request was refused as needing 260 blocks.
    engine = _window_engine(num_blocks=16, max_num_batched_tokens=1024)
    prompt, params = [7] * 20, SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
    assert _most_blocks_held(engine, prompt, params) <= engine.kv.max_blocks_per_sequence(620, 20)
    assert engine.kv.max_blocks_per_sequence(620, 20) <= 16


def test_the_window_bound_counts_a_prompts_last_segment_as_long_as_it_is():
    # A prompt past one segment was counted as if each later segment were a whole
    # window_step: a request that runs in 8 of 10 blocks was refused as needing 11.
    engine = make_engine(block_size=2, num_blocks=10, kv_window_tokens=4, kv_sink_tokens=0,
                         max_num_batched_tokens=16)  # fmt: skip
    prompt, params = list(range(3, 22)), SamplingParams(max_tokens=24, temperature=0,
                                                        ignore_eos=True)  # fmt: skip
    assert _most_blocks_held(engine, prompt, params) <= 10 and engine.stats.preemptions == 0


def _most_blocks_held(engine, prompt, params) -> int:
    """Runs the request alone, once ``validate`` accepts it: the most blocks it held."""
    engine.validate(prompt, params)
    held = []
    engine.add_request(prompt, params, "r")
    while engine.has_unfinished():
        engine.step()
        held.append(engine.kv.pool.num_used)
    return max(held)


def test_what_a_windowed_prompt_sees_does_not_depend_on_its_batch_or_the_cache(tiny_engine):
    # Its chunks follow the step budget that running decodes leave: the window used to
    # slide between them, so each token's context (and the greedy tokens) changed
    # with the traffic, and with a cached prefix.
    prompt = tiny_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog, again")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    options = dict(num_blocks=256, max_num_batched_tokens=8)
    alone = _window_engine(enable_prefix_caching=False, **options).generate([prompt], params)[0]

    busy = _window_engine(enable_prefix_caching=False, **options)
    for text in ("a" * 10, "b" * 12, "c" * 9):
        busy.add_request(tiny_engine.tokenizer.encode(text), SamplingParams(
            max_tokens=40, temperature=0, ignore_eos=True))  # fmt: skip
    for _ in range(3):
        busy.step()
    rid, got = busy.add_request(prompt, params), []
    while busy.has_unfinished():
        got += [t for out in busy.step() if out.request_id == rid for t in out.token_ids]
    assert got == alone

    warm = _window_engine(**options)
    warm.generate([prompt[:40]], SamplingParams(max_tokens=1, temperature=0))
    assert warm.generate([prompt], params)[0] == alone
    assert warm.kv.prefix_hit_tokens > 0


def _run(engine) -> tuple[list[int], int]:
    """Step ``engine`` to the end: (its tokens, the most blocks it held in a step)."""
    tokens, peak = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
        peak = max(peak, engine.kv.pool.num_used)
    return tokens, peak


@pytest.mark.parametrize("where", ["add_request", "prefill_here"])
def test_a_prompt_that_fits_as_its_first_segment_is_accepted_with_the_window_beyond(where):
    # A 40-token prompt is one segment (the step budget is 1024): it is held whole from
    # an empty table, then the window slides. The bound charged a full window before
    # it too (15 + 40 tokens, 14 blocks) and refused what 10 blocks run; a decode
    # worker's own prefill (prefill_here) must then reserve no more than that either,
    # or an idle worker refuses it as full for ever.
    prompt, params = [7] * 40, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    small = _window_engine(num_blocks=12)
    small.validate(prompt, params)
    getattr(small, where)(prompt, params, "r")
    tokens, peak = _run(small)
    big = _window_engine(num_blocks=64)
    getattr(big, where)(prompt, params, "r")
    assert tokens == _run(big)[0] and len(tokens) == 50
    assert peak <= small.kv.max_blocks_per_sequence(90, 1, 40) <= 12
    assert small.kv.pool.num_used == 0


@pytest.mark.parametrize("moved_after", [0, 5])
def test_a_prompt_computed_whole_is_reserved_as_the_window_holds_it(moved_after):
    # The router places a stream moved off a lost windowed worker with prompt_whole: its
    # reservation counted a full window before the prompt too (14 blocks of 12), and an
    # idle worker refused the stream as full for ever.
    prompt, params = [7] * 40, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    big = _window_engine(num_blocks=64, max_num_batched_tokens=16)
    big.prefill_here(prompt, params, "m", prompt_whole=True)
    expected = _run(big)[0]
    small = _window_engine(num_blocks=12, max_num_batched_tokens=16)
    small.prefill_here(prompt, params, "m", output_ids=expected[:moved_after], prompt_whole=True)
    tokens, peak = _run(small)
    assert tokens == expected[moved_after:]
    assert peak <= 12 and small.kv.pool.num_used == 0


def test_a_prompt_of_several_segments_is_reserved_for_its_next_segment_not_a_whole_one():
    # A decode worker's own prefill (prefill_here) of a 70-token prompt in segments of
    # 64 reserved for a second segment of 64 after the first, where the prompt has 6
    # left: 5 blocks of a pool of 4, refused on an idle engine for ever, though
    # add_request serves the same request in the same pool.
    prompt = [5 + i % 200 for i in range(70)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    options = dict(block_size=16, kv_sink_tokens=4, kv_window_tokens=16, num_blocks=4,
                   max_num_batched_tokens=64)  # fmt: skip
    colocated = make_engine(**options)
    colocated.validate(prompt, params)
    colocated.add_request(prompt, params, "r")
    expected = _run(colocated)[0]
    engine = make_engine(**options)
    engine.prefill_here(prompt, params, "r")
    tokens, peak = _run(engine)
    assert tokens == expected and len(tokens) == 8
    assert peak <= 4 and engine.kv.pool.num_used == 0
