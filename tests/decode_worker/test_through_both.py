"""A request driven by hand through both workers equals the colocated engine."""

from __future__ import annotations

import concurrent.futures

import pytest

from tandem._proto.tandem.v1 import tandem_pb2, worker_pb2
from tandem.config import PrefillConfig
from tandem.engine.kv_cache import bytes_per_block
from tandem.engine.sampling_params import SamplingParams
from tests.workers import (
    Pair,
    drive,
    engine_config,
    prefill,
    request,
    start_worker,
    stop_worker,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
PROMPTS = ("hello there", "你好，世界！" * 3, "long prompt " * 30)


def _colocated(engine, prompt, params):
    outs = list(engine.stream(prompt, params))
    return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_split_equals_colocated(tiny_engine, pair, params):
    served = pair.prefill.status().served, pair.decode.status().served
    for i, text in enumerate(PROMPTS):
        prompt = tiny_engine.tokenizer.encode(text)
        got = drive(pair, request(prompt, params, rid=f"r{i}"))
        assert (got.tokens, got.text) == _colocated(tiny_engine, prompt, params)
        last = got.chunks[-1]
        assert last.finish_reason == tandem_pb2.FINISH_REASON_LENGTH
        assert last.completion_tokens == params.max_tokens  # the first token counts
        assert all(c.finish_reason == 0 for c in got.chunks[:-1])
        assert got.prefill.kv_bytes > 0 and got.prefill.kv_transfer_seconds > 0
    n = len(PROMPTS)
    assert (pair.prefill.status().served, pair.decode.status().served) == (
        served[0] + n,
        served[1] + n,
    )


def test_first_token_that_ends_the_request_is_answered_by_prefill(tiny_engine, pair):
    prompt = tiny_engine.tokenizer.encode("one token only")
    params = SamplingParams(max_tokens=1, temperature=0)
    got = drive(pair, request(prompt, params))
    assert got.prefill.finish_reason in (
        tandem_pb2.FINISH_REASON_LENGTH,
        tandem_pb2.FINISH_REASON_STOP,
    )
    assert got.prefill.kv_bytes == 0
    assert (got.tokens, got.text) == _colocated(tiny_engine, prompt, params)


def test_concurrent_requests_are_batched_and_all_right(tiny_engine, pair):
    prompts = [tiny_engine.tokenizer.encode(f"prompt number {i} " * (i + 1)) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(drive, pair, request(p, GREEDY, rid=f"c{i}")) for i, p in enumerate(prompts)
        ]
        results = [f.result(60) for f in futures]
    for prompt, got in zip(prompts, results, strict=True):
        assert (got.tokens, got.text) == _colocated(tiny_engine, prompt, GREEDY)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_moved_with_its_earlier_output_continues_the_same_stream(
    tiny_engine, pair, params
):
    prompt = tiny_engine.tokenizer.encode(PROMPTS[1])
    outs = list(tiny_engine.stream(prompt, params))
    tokens = [o.token_ids[0] for o in outs]
    for k in (1, 5):
        got = drive(pair, request(prompt, params, rid=f"m{k}", output_ids=tokens[:k]))
        assert got.tokens == tokens[k:]
        assert got.text == "".join(o.text for o in outs[k:])
        last = got.chunks[-1]
        assert last.finish_reason == tandem_pb2.FINISH_REASON_LENGTH
        assert last.completion_tokens == params.max_tokens  # the earlier output counts


@pytest.mark.parametrize("layerwise", [True, False], ids=["layer-wise", "whole"])
def test_kv_goes_layer_by_layer_or_whole_and_decodes_the_same(tiny_engine, bg, pair, layerwise):
    config = PrefillConfig(engine=engine_config(), kv_layerwise=layerwise, kv_connect_timeout_s=5)
    prefill = start_worker(bg, config)
    sender, sent = prefill.server.sender, []
    real = sender.send_layers

    def spy(dest, blocks, layers):
        sent.append(layers)
        real(dest, blocks, layers)

    sender.send_layers = spy
    try:
        # A prompt the decode worker has not cached (it would not be sent again).
        prompt = tiny_engine.tokenizer.encode(f"{layerwise} long prompt " * 30)
        got = drive(Pair(prefill, pair.decode), request(prompt, GREEDY, rid=f"lw-{layerwise}"))
        assert (got.tokens, got.text) == _colocated(tiny_engine, prompt, GREEDY)
        layers = tiny_engine.model_config.num_layers
        assert sent == ([(i, i + 1) for i in range(layers)] if layerwise else [])
        # Either way all the KV is counted, and acknowledged once.
        kv = tiny_engine.kv
        per_block = bytes_per_block(tiny_engine.model_config, kv.block_size, kv.tensor.dtype)
        assert got.prefill.kv_bytes == kv.blocks_for(len(prompt)) * per_block
    finally:
        stop_worker(bg, prefill)


def test_a_prefix_the_decode_worker_holds_is_not_sent_again(tiny_engine, pair):
    system = tiny_engine.tokenizer.encode("a long shared system prompt " * 12)
    first = drive(pair, request(system + [11, 12], GREEDY, rid="p1"))
    second_prompt = system + [13, 14, 15]
    # By hand, as drive() does, to see the destination.
    req = request(second_prompt, GREEDY, rid="p2")
    stream = pair.decode.stub.Decode(worker_pb2.DecodeRequest(request=req), timeout=30)
    dest = next(stream).destination
    pre = prefill(pair.prefill, req, dest)
    tokens = [pre.first_token_id] + [t for r in stream for t in r.chunk.token_ids]
    assert tokens == _colocated(tiny_engine, second_prompt, GREEDY)[0]
    cached = len(system) // 16  # the system prompt's full blocks, cached after p1
    assert dest.skip_blocks == cached > 0
    blocks = -(-(len(second_prompt) + GREEDY.max_tokens) // 16)
    assert len(dest.block_ids) == blocks - cached
    # Only the blocks after the shared prefix went over the wire.
    prompt_blocks = -(-len(second_prompt) // 16)
    per_block = first.prefill.kv_bytes // -(-(len(system) + 2) // 16)
    assert pre.kv_bytes == per_block * (prompt_blocks - cached)


def test_an_id_whose_first_token_ended_it_can_be_sent_again(tiny_engine, pair):
    # Its layer-wise transfer was aborted when the first token ended it, and the
    # sender refused that id for good: the next request under it failed ABORTED.
    prompt = tiny_engine.tokenizer.encode("hello there")
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    assert len(drive(pair, request(prompt, one, rid="X")).tokens) == 1
    again = drive(pair, request(prompt, GREEDY, rid="X"))
    assert again.tokens == _colocated(tiny_engine, prompt, GREEDY)[0]
