"""Prefill in one engine, decode in another, the KV moved by a real transfer backend.

The client-visible result must equal one colocated engine, token for token.
"""

from __future__ import annotations

import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer import TransferState, make_receiver, make_sender
from tests.conftest import make_engine

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)


def _tp(n: int) -> dict:
    return {"tensor_parallel_size": n}


@pytest.mark.parametrize(
    ("prefill_settings", "decode_settings"),
    # An int8 cache moves its values and their scales: the same tokens as one int8
    # engine. Tensor-parallel engines move every rank's heads (one shared cache each),
    # into a decode worker of the same width or another (heads re-split; every pair of
    # widths in tests/kv_transfer/test_heads.py, 1 to 2 in tests/e2e).
    [({}, {}), ({"kv_cache_dtype": "int8"},) * 2, (_tp(2), _tp(2)), (_tp(2), {})],
    ids=["auto", "int8", "tp2", "tp2to1"],
)
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("backend", ["inproc", "ucx"])
def test_split_over_a_transfer_backend_equals_colocated(
    tiny_engine, backend, params, prefill_settings, decode_settings
):
    int8 = "kv_cache_dtype" in prefill_settings
    colocated = make_engine(**prefill_settings) if int8 else tiny_engine
    prefill = make_engine(**prefill_settings)
    decode = make_engine(num_blocks=64, **decode_settings)
    receiver = make_receiver(backend, decode.kv.tensor, decode.kv_fingerprint())
    sender = make_sender(backend, prefill.kv.tensor, prefill.kv_fingerprint())
    try:
        for i, text in enumerate(("hello there", "你好，世界！" * 3, "long prompt " * 30)):
            prompt = tiny_engine.tokenizer.encode(text)
            rid = f"r{i}"
            dest = receiver.expect(rid, decode.reserve(prompt, params, rid), lease_s=30)
            prefill.add_request(prompt, params, rid, prefill_only=True)
            (first,) = prefill.step()
            # Only KV and the first token travel: seeded sampling needs no state.
            fut = sender.send(dest, first.held_block_ids, first.token_ids[0])
            assert fut.result(30).state is TransferState.DONE
            prefill.release(rid)  # the decode side confirmed: the prefill blocks are free
            arrived = receiver.poll(rid)
            receiver.release(rid)
            out = decode.admit(rid, arrived.first_token)
            tokens, text_out = list(first.token_ids), first.text
            while not out.finished:
                for out in decode.step():
                    tokens += out.token_ids
                    text_out += out.text
            expected = list(colocated.stream(prompt, params))
            assert tokens == [t for o in expected for t in o.token_ids]
            assert text_out == "".join(o.text for o in expected)
    finally:
        sender.close()
        receiver.close()
        prefill.close()
        decode.close()
    for engine in (prefill, decode):
        engine.kv.pool.check_integrity()
        assert engine.kv.pool.num_used == 0


def test_a_continued_request_ships_the_kv_of_its_earlier_output_too(tiny_engine):
    prompt = tiny_engine.tokenizer.encode("你好，世界！")  # 18 tokens
    expected = list(tiny_engine.stream(prompt, SEEDED))
    earlier = [o.token_ids[0] for o in expected[:6]]  # 24 tokens of KV: 2 blocks
    prefill, decode = make_engine(), make_engine(num_blocks=64)
    receiver = make_receiver("inproc", decode.kv.tensor, decode.kv_fingerprint())
    sender = make_sender("inproc", prefill.kv.tensor, prefill.kv_fingerprint())
    try:
        dest = receiver.expect("m", decode.reserve(prompt, SEEDED, "m", earlier), lease_s=30)
        prefill.add_request(prompt, SEEDED, "m", prefill_only=True, output_ids=earlier)
        (first,) = prefill.step()
        assert len(first.held_block_ids) == 2
        status = sender.send(dest, first.held_block_ids, first.token_ids[0]).result(30)
        assert status.state is TransferState.DONE
        prefill.release("m")
        arrived = receiver.poll("m")
        receiver.release("m")
        out = decode.admit("m", arrived.first_token)
        tokens, text = list(first.token_ids), first.text
        while not out.finished:
            for out in decode.step():
                tokens += out.token_ids
                text += out.text
    finally:
        sender.close()
        receiver.close()
    assert tokens == [t for o in expected[6:] for t in o.token_ids]
    assert text == "".join(o.text for o in expected[6:])
    for engine in (prefill, decode):
        engine.kv.pool.check_integrity()
        assert engine.kv.pool.num_used == 0


@pytest.mark.parametrize(
    ("prefill_settings", "decode_settings", "named"),
    [
        ({"block_size": 16}, {"block_size": 32}, "block_size: prefill 16, decode 32"),
        ({"kv_cache_dtype": "int8"}, {}, "kv_cache_dtype: prefill int8, decode auto"),
    ],
    ids=["block_size", "kv_cache_dtype"],
)
def test_engines_with_different_kv_layouts_refuse_each_other_by_name(
    prefill_settings, decode_settings, named
):
    from tandem.kv_transfer import HandshakeError

    prefill, decode = make_engine(**prefill_settings), make_engine(num_blocks=8, **decode_settings)
    receiver = make_receiver("inproc", decode.kv.tensor, decode.kv_fingerprint())
    sender = make_sender("inproc", prefill.kv.tensor, prefill.kv_fingerprint())
    try:
        dest = receiver.expect("r", decode.reserve([5] * 20, GREEDY, "r"), lease_s=5)
        with pytest.raises(HandshakeError, match=named):
            sender.send(dest, [0], 1).result(5)
    finally:
        receiver.release("r")
        decode.abort("r")
        sender.close()
        receiver.close()
        decode.close()
    assert decode.kv.pool.num_used == 0
