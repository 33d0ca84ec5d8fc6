"""The engine split in two: prefill in one engine, decode in another, KV copied between.

Whatever the split, the client must see exactly what one colocated engine gives.
The copy here is a plain tensor copy; tests/kv_transfer moves the same blocks
between processes.
"""

from __future__ import annotations

import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.errors import InvalidRequestError, OutOfBlocksError
from tests.conftest import make_engine

# Greedy, seeded sampling, and a first token that ends the request.
CASES = pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0),
    ],
    ids=["greedy", "seeded", "one-token"],
)


@pytest.fixture(scope="module")
def pair():
    return make_engine(), make_engine(num_blocks=64)


def _split(prefill, decode, prompt, params, rid="r1"):
    """Run one request disaggregated; returns (token ids, text) as a client sees them."""
    prefill.add_request(prompt, params, rid, prefill_only=True)
    outs = []
    while not outs:
        outs = prefill.step()
    (first,) = outs
    tokens, text = list(first.token_ids), first.text
    if first.held_block_ids is None:  # the first token ended the request
        return tokens, text
    dst = decode.reserve(prompt, params, rid)
    src = first.held_block_ids
    decode.kv.tensor[:, :, dst[: len(src)]] = prefill.kv.tensor[:, :, src]
    prefill.release(rid)
    out = decode.admit(rid, tokens[0])  # its text was streamed by prefill
    while not out.finished:
        for out in decode.step():
            tokens += out.token_ids
            text += out.text
    return tokens, text


def _colocated(engine, prompt, params):
    outs = list(engine.stream(prompt, params))
    return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs)


@CASES
def test_split_equals_colocated(tiny_engine, pair, params):
    prefill, decode = pair
    for text in ("hello there", "你好，世界！" * 3, "long prompt " * 20):
        prompt = tiny_engine.tokenizer.encode(text)
        assert _split(prefill, decode, prompt, params) == _colocated(tiny_engine, prompt, params)
    for engine in pair:
        engine.kv.pool.check_integrity()
        assert engine.kv.pool.num_used == 0


def test_stop_string_across_the_split(tiny_engine, pair):
    prompt = tiny_engine.tokenizer.encode("stop test")
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = _colocated(tiny_engine, prompt, greedy)[1]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(full[1:4],))
    assert _split(*pair, prompt, params) == _colocated(tiny_engine, prompt, params)


def test_reserve_refuses_what_does_not_fit_and_abort_frees(pair):
    _, decode = pair
    params = SamplingParams(max_tokens=200, temperature=0)
    # 100 prompt tokens + the 128 output tokens reserved up front: 15 of 64 blocks.
    held = decode.reserve([5] * 100, params, "big")
    assert len(held) == 15 and decode.kv.pool.num_used == 15
    for rid in ("big2", "big3", "big4"):
        decode.reserve([5] * 100, params, rid)
    with pytest.raises(OutOfBlocksError, match="needs 15 more KV blocks, 4 free"):
        decode.reserve([5] * 100, params, "big5")
    for rid in ("big", "big2", "big3", "big4"):
        assert decode.abort(rid)
    assert decode.kv.pool.num_used == 0 and not decode.has_unfinished()


def test_a_refusal_counts_the_blocks_free_before_its_cached_prefix_is_let_go():
    engine = make_engine(num_blocks=8, reserve_output_tokens=16)
    prefix = list(range(1, 65))  # 4 full blocks, cached once the request ends
    list(engine.stream(prefix, SamplingParams(max_tokens=1, ignore_eos=True)))
    engine.prefill_here(list(range(100, 130)), SamplingParams(max_tokens=16), "B")  # 3 blocks
    assert engine.kv.pool.num_free == 5  # 1 empty + the 4 cached, evictable
    with pytest.raises(OutOfBlocksError, match=r"needs 3 more KV blocks \(4 of its prefix "
                       r"cached\), 1 free"):  # fmt: skip
        engine.prefill_here(prefix + list(range(140, 172)), SamplingParams(max_tokens=16), "C")
    assert engine.kv.pool.num_free == 5


@pytest.mark.parametrize("ahead", [None, 1])
def test_reservations_hold_what_is_used_and_grow_past_it(tiny_engine, ahead):
    """Three 40-token prompts asking for 200 tokens each, on a decode engine of 24 blocks
    of 16: the worst case (prompt + max_tokens, 15 blocks) admits one at a time; a
    reservation of the tokens so far plus ``ahead`` (3 blocks) admits all three, which
    then outgrow the pool, are preempted and recomputed, and still give exactly the
    colocated tokens."""
    prefill = make_engine()
    decode = make_engine(num_blocks=24, reserve_output_tokens=ahead, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    prompts = {f"r{i}": [10 + i] * 40 for i in range(3)}
    tokens, held = {}, {}
    for rid, prompt in prompts.items():
        prefill.add_request(prompt, params, rid, prefill_only=True)
    while len(tokens) < len(prompts):
        for first in prefill.step():
            tokens[first.request_id] = list(first.token_ids)
            held[first.request_id] = first.held_block_ids
    reserved = {}
    for rid, prompt in prompts.items():
        try:
            reserved[rid] = decode.reserve(prompt, params, rid)
        except OutOfBlocksError:
            pass
    if ahead is None:
        assert list(reserved) == ["r0"] and len(reserved["r0"]) == 15
        assert decode.abort("r0")
        return
    # The prompt and the first token, then the one token ahead: 41 tokens, 3 blocks.
    assert list(reserved) == ["r0", "r1", "r2"] and decode.kv.pool.num_used == 9
    for rid, dst in reserved.items():
        decode.kv.tensor[:, :, dst[: len(held[rid])]] = prefill.kv.tensor[:, :, held[rid]]
        prefill.release(rid)
    admitted = list(reserved)
    outs = [decode.admit(rid, tokens[rid][0]) for rid in admitted]
    assert not any(o.finished for o in outs)
    done = set()
    while len(done) < len(admitted):
        for out in decode.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                done.add(out.request_id)
    assert decode.stats.preemptions > 0  # 3 x 240 tokens do not fit 24 blocks at once
    for rid, prompt in prompts.items():
        assert tokens[rid] == _colocated(tiny_engine, prompt, params)[0], rid
    decode.kv.pool.check_integrity()
    assert decode.kv.pool.num_used == 0


def test_release_and_abort_of_held_kv(pair):
    prefill, _ = pair
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prefill.add_request([7] * 40, params, "held", prefill_only=True)
    (out,) = prefill.step()
    assert out.finished and out.finish_reason is None and len(out.held_block_ids) == 3
    assert prefill.kv.pool.num_used == 3 and not prefill.has_unfinished()
    assert prefill.abort("held") and prefill.kv.pool.num_used == 0
    assert not prefill.release("held")


def test_layer_by_layer_kv_taken_during_the_step_equals_the_whole(pair):
    """What ``on_prefill_layer`` sees after each layer is that layer's final KV: copied
    out layer by layer during the step, it decodes as the colocated engine does."""
    prefill, decode = make_engine(max_num_batched_tokens=16), pair[1]  # prompt in 3 chunks
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = list(range(5, 45))
    calls, copies = [], {}

    def on_layer(layer, done):
        calls.append((layer, [rid for rid, _ in done]))
        for rid, blocks in done:
            copies.setdefault(rid, prefill.kv.tensor[:, :, blocks].clone())[layer] = (
                prefill.kv.tensor[layer, :, blocks]
            )

    prefill.on_prefill_layer = on_layer
    prefill.add_request(prompt, params, "lw", prefill_only=True)
    prefill.add_request([7, 8, 9], SamplingParams(max_tokens=1), "one", prefill_only=True)
    outs = []
    while not any(o.request_id == "lw" for o in outs):
        outs += prefill.step()
    layers = prefill.model_config.num_layers
    # Once per layer, in the step that completes the prompt; never for a request whose
    # first token is its last (max_tokens=1).
    assert calls == [(i, ["lw"]) for i in range(layers)]
    first = next(o for o in outs if o.request_id == "lw")
    dst = decode.reserve(prompt, params, "lw")
    src = first.held_block_ids
    decode.kv.tensor[:, :, dst[: len(src)]] = copies["lw"]  # the layer-wise copy, not the end
    prefill.release("lw")
    tokens = list(first.token_ids)
    out = decode.admit("lw", tokens[0])
    while not out.finished:
        for out in decode.step():
            tokens += out.token_ids
    want = [t for o in pair[0].stream(prompt, params) for t in o.token_ids]
    assert tokens == want
    prefill.kv.pool.check_integrity()
    assert prefill.kv.pool.num_used == 0


def _here(decode, prompt, params, rid="h1"):
    """Run one request prefilled on the decode engine itself (no KV transfer); returns
    (prompt tokens found in its prefix cache, (token ids, text))."""
    before = decode.kv.prefix_hit_tokens
    decode.prefill_here(prompt, params, rid)
    hit = decode.kv.prefix_hit_tokens - before
    tokens, text, finished = [], "", False
    while not finished:
        for out in decode.step():
            tokens += out.token_ids
            text += out.text
            finished = out.finished
    return hit, (tokens, text)


@CASES
def test_prefill_here_equals_colocated(tiny_engine, pair, params):
    _, decode = pair
    prompt = tiny_engine.tokenizer.encode("long prompt " * 20)
    assert _here(decode, prompt, params)[1] == _colocated(tiny_engine, prompt, params)
    assert decode.kv.pool.num_used == 0 or decode.kv.enable_prefix_caching
    decode.kv.pool.check_integrity()


def test_prefill_here_reuses_the_decode_workers_prefix_cache(tiny_engine):
    decode = make_engine(num_blocks=64)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    system = tiny_engine.tokenizer.encode("you are a helpful assistant " * 8)
    first = system + tiny_engine.tokenizer.encode(" first question")
    second = system + tiny_engine.tokenizer.encode(" another one")
    assert _here(decode, first, params, "a")[0] == 0
    hit, got = _here(decode, second, params, "b")
    assert hit == len(system) // 16 * 16 > 0  # whole blocks of the shared system prompt
    assert got == _colocated(tiny_engine, second, params)


def test_a_decode_workers_lookups_for_shipped_prompts_are_counted_apart():
    # A hit there is a block not sent; the prefill worker counts the same prompt's
    # lookup for what it computes. Summing both pools counted such a prompt twice.
    decode = make_engine(num_blocks=64)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    system = [9] * 40
    decode.prefill_here([*system, 1], params, "here")
    while decode.has_unfinished():
        decode.step()
    decode.reserve_for_transfer([*system, 2], params, "shipped")
    kv = decode.kv
    assert (kv.prefix_query_tokens, kv.prefix_hit_tokens) == (82, 32)
    assert (kv.shipped_query_tokens, kv.shipped_hit_tokens) == (41, 32)
    decode.abort_all()


def test_prefill_here_that_does_not_fit_keeps_no_block(tiny_engine):
    decode = make_engine(num_blocks=12)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = [9] * 40
    _here(decode, prompt, params, "warm")  # its 2 full prompt blocks stay cached
    decode.reserve([1] * 100, SamplingParams(max_tokens=28, temperature=0), "hold")  # 8 blocks
    used = decode.kv.pool.num_used
    with pytest.raises(OutOfBlocksError, match="KV blocks"):
        decode.prefill_here(prompt, SamplingParams(max_tokens=40, temperature=0), "big")
    assert decode.kv.pool.num_used == used
    assert decode.abort("hold") and not decode.has_unfinished()
    decode.kv.pool.check_integrity()


def test_a_decode_worker_with_a_kv_window_slides_the_arrived_kv(tiny_engine):
    # The prefill side ships every block; the decode side keeps the sinks and the window
    # from admission on, as the colocated engine with the same window does.
    window = dict(block_size=4, kv_sink_tokens=4, kv_window_tokens=8)
    prefill = make_engine(block_size=4)
    decode = make_engine(num_blocks=24, **window)
    prompt = tiny_engine.tokenizer.encode("hello there, general kenobi")  # past the window
    assert len(prompt) >= 4 + 8 + 4
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = _colocated(make_engine(**window), prompt, params)
    assert _split(prefill, decode, prompt, params) == expected
    assert decode.kv.window_evicted_blocks > 0
    for engine in (prefill, decode):
        engine.kv.pool.check_integrity()
        assert engine.kv.pool.num_used == 0


def test_a_decode_worker_with_a_kv_window_reuses_its_cached_prefix_in_place(tiny_engine):
    # The second request finds the first's prompt in the decode side's prefix cache:
    # the sender skips those blocks, so the rest must land where they belong, which
    # holds only if the reservation keeps the whole prompt until the KV has arrived.
    window = dict(block_size=4, kv_sink_tokens=4, kv_window_tokens=8)
    prefill = make_engine(block_size=4)
    decode = make_engine(num_blocks=48, **window)
    prompt = tiny_engine.tokenizer.encode("hello there, general kenobi, you are a bold one")
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected = _colocated(make_engine(**window), prompt, params)[0]
    for rid in ("first", "second"):
        prefill.add_request(prompt, params, rid, prefill_only=True)
        outs = []
        while not outs:
            outs = prefill.step()
        (first,) = outs
        dst, skip = decode.reserve_for_transfer(prompt, params, rid)
        src = first.held_block_ids
        assert len(dst) >= len(src) and (skip > 0) == (rid == "second")
        decode.kv.tensor[:, :, dst[skip : len(src)]] = prefill.kv.tensor[:, :, src[skip:]]
        prefill.release(rid)
        out = decode.admit(rid, first.token_ids[0])
        tokens = list(first.token_ids)
        while not out.finished:
            for out in decode.step():
                tokens += out.token_ids
        assert tokens == expected, rid
    for engine in (prefill, decode):
        engine.kv.pool.check_integrity()
        assert engine.kv.pool.num_used == 0


def test_a_decode_worker_runs_its_preempted_requests_again_before_new_ones():
    # Requests grow past what they reserved and preempt each other; new ones keep
    # arriving between steps, as the engine loop runs its commands. They must not take
    # the slot and blocks that a preempted request waits for (it would wait for ever),
    # nor, with reservations, push the batch past max_num_seqs.
    decode = make_engine(num_blocks=10, block_size=4, max_num_seqs=2, reserve_output_tokens=1,
                         enable_prefix_caching=False)  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    decode.prefill_here([7] * 8, params, "A")
    decode.prefill_here([9] * 8, params, "B")
    finished, refused, offered = [], set(), 0
    for _ in range(400):
        try:
            prompt = [20 + offered % 50] * 8
            if offered % 2:
                decode.prefill_here(prompt, params, f"C{offered}")
            else:  # a reservation, its KV "arriving" at once
                decode.reserve(prompt, params, f"C{offered}")
                decode.admit(f"C{offered}", 5)
            offered += 1
        except OutOfBlocksError as exc:
            refused.add(str(exc).split(" ", 1)[1])
        finished += [o.request_id for o in decode.step() if o.finished]
        assert decode.scheduler.slots_taken() <= 2
        if "A" in finished and "B" in finished and decode.stats.preemptions:
            break
    assert "A" in finished and "B" in finished, decode.scheduler.waiting
    assert "preempted requests wait to run again first" in refused
    decode.abort_all()
    assert decode.kv.pool.num_used == 0


def test_a_decode_side_prompt_is_looked_up_in_the_prefix_cache_once_however_often_preempted():
    # prefill_here counts its lookup; a preemption recomputed later must not count the
    # sequence's own freed blocks as hits (the hit rate would grow with memory pressure).
    engine = make_engine(num_blocks=6, reserve_output_tokens=1, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.prefill_here(list(range(100, 132)), params, "a")
    engine.prefill_here(list(range(200, 232)), params, "b")
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.preemptions > 0
    assert (engine.kv.prefix_query_tokens, engine.kv.prefix_hit_tokens) == (64, 0)


def test_a_windowed_decode_worker_caches_only_arrived_kv_it_would_have_computed(tiny_engine):
    # The prefill side computes a prompt with full attention; past the first slide a
    # windowed engine computes it otherwise. Those blocks entered the prefix cache, and
    # a later prompt prefilled here read them: its tokens depended on what came before.
    window = dict(block_size=4, kv_sink_tokens=4, kv_window_tokens=8, max_num_batched_tokens=8)
    prompt = tiny_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog, again")
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    cold = _here(make_engine(**window), prompt, params)[1]
    decode = make_engine(num_blocks=64, **window)
    _split(make_engine(block_size=4), decode, prompt, params, "shipped")
    hit, warm = _here(decode, prompt, params)
    assert warm == cold and 0 < hit < len(prompt) - 8


def test_a_windowed_stream_continued_where_it_decodes_goes_on_as_undisturbed():
    # A request moved off a lost worker after 300 tokens: prompt and tokens are past
    # the pool, so no KV of them can be held whole. Prefilled where it decodes (its
    # generated tokens recomputed one at a time, as they were first computed), it
    # continues with the undisturbed run's tokens in the window's memory.
    window = dict(block_size=16, num_blocks=16, kv_sink_tokens=4, kv_window_tokens=32,
                  max_num_batched_tokens=32)  # fmt: skip
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
    undisturbed = make_engine(**window).generate([prompt], params)[0]
    decode = make_engine(**window)
    decode.prefill_here(prompt, params, "moved", output_ids=undisturbed[:300])
    tokens, held = [], []
    while decode.has_unfinished():
        tokens += [t for out in decode.step() for t in out.token_ids]
        held.append(decode.kv.pool.num_used)
    assert tokens == undisturbed[300:]
    assert max(held) <= decode.kv.max_blocks_per_sequence(620, 32) < 16
    assert decode.kv.pool.num_used == 0


@pytest.mark.parametrize("text", ["The quick brown fox jumps over the lazy dog, again and again",
                                  "hello there, how are you doing today my friend?"])  # fmt: skip
def test_a_shipped_windowed_stream_moved_goes_on_as_undisturbed(tiny_engine, text):
    # Its prompt's KV came whole from a prefill worker: computed again in the window's
    # segments by the decode worker it moved to, it was other KV past the first slide,
    # and other tokens followed.
    window = dict(block_size=4, kv_sink_tokens=4, kv_window_tokens=8, max_num_batched_tokens=8)
    prompt = tiny_engine.tokenizer.encode(text)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    undisturbed = _split(make_engine(block_size=4), make_engine(num_blocks=64, **window), prompt,
                         params)[0]  # fmt: skip
    moved = make_engine(num_blocks=64, **window)
    moved.prefill_here(prompt, params, "moved", output_ids=undisturbed[:10], prompt_whole=True)
    rest = []
    while moved.has_unfinished():
        rest += [t for out in moved.step() for t in out.token_ids]
    assert rest == undisturbed[10:]
    assert moved.kv.pool.num_used == 0 or moved.kv.enable_prefix_caching


def test_a_prefill_worker_checks_only_what_it_holds_against_its_pool():
    # It holds the prompt whole and nothing more: checked against prompt + max_tokens,
    # a 20-token prompt with max_tokens 200 was refused by a 16-block prefill worker
    # whose decode worker had room for it.
    prefill = make_engine(block_size=4, num_blocks=16)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    prefill.validate([7] * 20, params, prefill_only=True)
    prefill.add_request([7] * 20, params, "p", prefill_only=True)
    outs = []
    while not outs:
        outs = prefill.step()
    assert len(outs[0].held_block_ids) == 5
    prefill.release("p")
    with pytest.raises(InvalidRequestError, match="ships the KV of 80 tokens whole: 20 KV"):
        prefill.validate([7] * 80, params, prefill_only=True)
