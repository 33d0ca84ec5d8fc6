"""Continuing a request after output it already produced (request migration).

A request whose worker failed mid-stream is sent again with the tokens the client
already has (``output_ids``). Whatever k of them there are, the engine must go
on with exactly the undisturbed run's next tokens, text deltas, finish reason and
counts: colocated, and split in two (prefill continues, decode takes over).

tiny-random's tokenizer is byte-level, so its output is full of characters split
over tokens: many steps emit no text, and a resume right after one of them must
still emit the held-back bytes with the same later delta.
"""

from __future__ import annotations

import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.errors import InvalidRequestError
from tests.conftest import make_engine

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
PROMPTS = ("hello there", "你好，世界！")


def _view(out) -> tuple:
    """What a client learns from one output (the request id aside)."""
    return (
        out.token_ids,
        out.text,
        out.finished,
        out.finish_reason,
        out.num_prompt_tokens,
        out.num_output_tokens,
    )


def _run(engine, prompt, params, output_ids=()) -> list[tuple]:
    rid = engine.add_request(prompt, params, output_ids=output_ids)
    outs: list[tuple] = []
    while not (outs and outs[-1][2]):
        outs += [_view(o) for o in engine.step() if o.request_id == rid]
    return outs


def _with_stop(engine, prompt) -> SamplingParams:
    """Greedy, stopped by a string whose first characters are held back over several steps."""
    text = "".join(o[1] for o in _run(engine, prompt, GREEDY))
    return SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(text[5:8],))


def _cases(engine) -> list[tuple[str, list[int], SamplingParams]]:
    cases = []
    for text in PROMPTS:
        prompt = engine.tokenizer.encode(text)
        cases += [(f"{text}/greedy", prompt, GREEDY), (f"{text}/seeded", prompt, SEEDED)]
    prompt = engine.tokenizer.encode(PROMPTS[0])
    cases.append((f"{PROMPTS[0]}/stop", prompt, _with_stop(engine, prompt)))
    return cases


def _resume_points(full: list[tuple]) -> list[int]:
    """k = 1, right after the first step whose text was held back and the one after it,
    halfway, and one token short of the end (the continuation's first token ends it)."""
    held = next(k for k in range(1, len(full)) if full[k - 1][1] == "")
    return sorted({1, held, held + 1, len(full) // 2, len(full) - 1})


def test_the_cases_cover_held_back_text_and_both_finish_reasons(tiny_engine):
    runs = {name: _run(tiny_engine, p, params) for name, p, params in _cases(tiny_engine)}
    # Steps whose text waits for a later token (a split character or a possible stop).
    assert all(any(o[1] == "" for o in outs[:-1]) for outs in runs.values())
    stop, plain = runs["hello there/stop"], runs["hello there/greedy"]
    assert stop[-1][3].value == "stop" and len(stop) < len(plain)
    assert [o[1] for o in stop[:-1]] != [o[1] for o in plain[: len(stop) - 1]]
    assert {outs[-1][3].value for name, outs in runs.items() if "stop" not in name} == {"length"}


def test_continuing_after_k_tokens_equals_the_undisturbed_run(tiny_engine):
    for name, prompt, params in _cases(tiny_engine):
        full = _run(tiny_engine, prompt, params)
        tokens = [o[0][0] for o in full]
        # The stop case, shortest, at every k: each step of the stop-string hold-back.
        points = range(1, len(full)) if "stop" in name else _resume_points(full)
        for k in points:
            assert _run(tiny_engine, prompt, params, tokens[:k]) == full[k:], (name, k)


def test_earlier_output_counts_towards_max_tokens(tiny_engine):
    prompt = tiny_engine.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    tokens = [o[0][0] for o in _run(tiny_engine, prompt, params)]
    (last,) = _run(tiny_engine, prompt, params, tokens[:4])
    assert last[0] == tokens[4:] and last[3].value == "length"
    assert (last[4], last[5]) == (len(prompt), 5)


@pytest.mark.parametrize(
    ("output_ids", "message"),
    [
        ([1] * 5, r"output_token_ids must be fewer than max_tokens \(5\), got 5"),
        ([1, 100_000], r"output token id 100000 is outside \[0, "),
    ],
)
def test_bad_earlier_output_is_refused_before_any_block_is_taken(tiny_engine, output_ids, message):
    params = SamplingParams(max_tokens=5, temperature=0)
    with pytest.raises(InvalidRequestError, match=message) as info:
        tiny_engine.add_request([1, 2, 3], params, output_ids=output_ids)
    assert info.value.field == "output_token_ids"
    with pytest.raises(InvalidRequestError, match=message):
        tiny_engine.reserve([1, 2, 3], params, "r", output_ids=output_ids)
    assert tiny_engine.kv.pool.num_used == 0 and not tiny_engine.has_unfinished()


# ---- the same, split over a prefill and a decode engine ------------------------------


@pytest.fixture(scope="module")
def pair():
    return make_engine(), make_engine(num_blocks=64)


def _split(prefill, decode, prompt, params, output_ids, rid) -> list[tuple]:
    """One continued request disaggregated; what the client sees, as ``_run`` gives it."""
    prefill.add_request(prompt, params, rid, prefill_only=True, output_ids=output_ids)
    outs = []
    while not outs:
        outs = prefill.step()
    (first,) = outs
    if first.held_block_ids is None:  # the first token ended the request
        return [_view(first)]
    # The held KV covers the prompt and the earlier output, not just the prompt.
    assert len(first.held_block_ids) == prefill.kv.blocks_for(len(prompt) + len(output_ids))
    dst = decode.reserve(prompt, params, rid, output_ids)
    assert len(dst) == decode.kv.blocks_for(len(prompt) + params.max_tokens)
    src = first.held_block_ids
    decode.kv.tensor[:, :, dst[: len(src)]] = prefill.kv.tensor[:, :, src]
    prefill.release(rid)
    admitted = decode.admit(rid, first.token_ids[0])
    # The prefill worker streamed the first token's ids and text; the decode side's
    # own output for it says whether it finished, and the counts.
    assert (admitted.token_ids, admitted.text) == (first.token_ids, first.text)
    if not admitted.finished:  # all the KV that arrived counts as computed: none is redone
        assert decode._requests[rid].seq.num_computed == len(prompt) + len(output_ids)
    client = [_view(admitted)]
    while not client[-1][2]:
        client += [_view(o) for o in decode.step()]
    return client


def test_split_continuation_equals_the_undisturbed_run(tiny_engine, pair):
    prefill, decode = pair
    for name, prompt, params in _cases(tiny_engine):
        full = _run(tiny_engine, prompt, params)
        tokens = [o[0][0] for o in full]
        for k in _resume_points(full):
            got = _split(prefill, decode, prompt, params, tokens[:k], f"{name}/{k}")
            assert got == full[k:], (name, k)
    for engine in pair:
        engine.kv.pool.check_integrity()
        assert engine.kv.pool.num_used == 0 and not engine.has_unfinished()
