"""Bad input: INVALID_ARGUMENT with the field and the limit, before any worker is contacted."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem._proto.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from tandem.client import InvalidRequest
from tests.router.fakes import FakeDecode, cluster, wait_until

S = tandem_pb2.SamplingParams
M = tandem_pb2.ChatMessage


def hi(**sampling) -> dict:
    return dict(prompt="hi", sampling=S(**sampling))


NAN, INF = float("nan"), float("inf")
CHAT_BAD_ROLE = tandem_pb2.Chat(
    messages=[M(role="user", content="a"), M(role="robot", content="b")]
)
CASES = [
    (hi(max_tokens=0), "max_tokens must be >= 1, got 0"),
    (hi(max_tokens=-3), "max_tokens must be >= 1, got -3"),
    (hi(temperature=-0.5), "temperature must be finite and >= 0, got -0.5"),
    (hi(temperature=NAN), "temperature must be finite and >= 0, got nan"),
    (hi(temperature=INF), "temperature must be finite and >= 0, got inf"),
    (hi(top_p=0), "top_p must be in (0, 1], got 0.0"),
    (hi(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (hi(top_k=-1), "top_k must be >= 0 (0 disables it), got -1"),
    (hi(min_p=-0.5), "min_p must be in [0, 1], got -0.5"),
    (hi(min_p=1.5), "min_p must be in [0, 1], got 1.5"),
    (hi(repetition_penalty=0), "repetition_penalty must be finite and > 0, got 0.0"),
    # Past these, logits overflow to inf and the step fails every request batched with it.
    (hi(temperature=1e-38), "temperature must be 0 (greedy) or at least 1e-05, got 1e-38"),
    (hi(repetition_penalty=0.001), "repetition_penalty must be in [0.01, 100], got 0.001"),
    (hi(repetition_penalty=1000), "repetition_penalty must be in [0.01, 100], got 1000"),
    (hi(stop=["ok", ""]), "stop strings must be non-empty, got an empty stop[1]"),
    (dict(prompt=""), "prompt must not be empty"),
    (dict(), "one of prompt or chat must be set"),
    (dict(chat=tandem_pb2.Chat()), "chat.messages must not be empty"),
    (
        dict(chat=CHAT_BAD_ROLE),
        "chat.messages[1].role must be one of system, user, assistant, got 'robot'",
    ),
    (
        # tiny-random: byte-level, no BOS, context 4096; "hello" is 5 tokens.
        dict(prompt="hello", sampling=S(max_tokens=4092)),
        "prompt (5 tokens) + max_tokens (4092) = 4097 exceeds the context length 4096",
    ),
]


@pytest.mark.parametrize("fields, message", CASES, ids=[m for _, m in CASES])
def test_bad_input_is_refused_before_any_worker_call(frontend, fields, message):
    async def scenario():
        async with cluster(frontend) as c:
            stub = tandem_pb2_grpc.TandemStub(c.client._channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(tandem_pb2.GenerateRequest(**fields), timeout=5):
                    pass
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == message
            assert c.worker_calls() == 0

    asyncio.run(scenario())


def test_context_length_boundary_is_allowed(frontend):
    async def scenario():
        async with cluster(frontend) as c:
            done = await c.client.complete("hello", max_tokens=4091)
            assert done.finish_reason == "length"

    asyncio.run(scenario())


def test_a_prompt_near_the_context_without_max_tokens_stops_at_the_contexts_end(frontend):
    # The default of 256 refused such a prompt, naming a max_tokens the client never
    # sent; OpenAI and vLLM stop at the context's end instead. One that is given is
    # still held to the context.
    async def scenario():
        async with cluster(frontend) as c:
            sent = []
            for prompt in ("x" * 4000, "x" * 10):
                await c.client.complete(prompt)
                sent.append(c.prefill[0].calls[-1].request.request.sampling.max_tokens)
            assert sent == [96, 256]  # 4096 - 4000; the default where the context has room
            with pytest.raises(InvalidRequest, match=r"\+ max_tokens \(256\) = 4256 exceeds"):
                await c.client.complete("x" * 4000, max_tokens=256)
            with pytest.raises(
                InvalidRequest,
                match=r"^INVALID_ARGUMENT: prompt \(4096 tokens\) "
                r"leaves no room to generate in the context length 4096$",
            ):
                await c.client.complete("x" * 4096)  # not "max_tokens (256)", never sent

    asyncio.run(scenario())


def test_a_decode_pool_smaller_than_the_context_bounds_what_is_served(frontend):
    # A decode worker refuses a sequence its whole KV pool cannot hold. The router knew
    # only the context: a request that fit it (max_tokens unset, the default) reached
    # the worker and was refused in the worker's words, and GetModelInfo promised the
    # context.
    async def scenario():
        decode = FakeDecode(kv_blocks_total=64)  # 1024 tokens in blocks of 16
        async with cluster(frontend, decode=[decode]) as c:
            await wait_until(lambda: c.router.gateway.sequence_capacity(), what="a poll")
            assert (await c.client.model_info()).context_length == 1024
            await c.client.complete("x" * 900)
            assert decode.calls[-1].request.request.sampling.max_tokens == 124
            with pytest.raises(InvalidRequest, match=r"^INVALID_ARGUMENT: prompt \(900 tokens\) "
                               r"\+ max_tokens \(400\) = 1300 exceeds what a decode worker's KV "
                               r"pool holds for one sequence \(1024 tokens\)$"):  # fmt: skip
                await c.client.complete("x" * 900, max_tokens=400)
            with pytest.raises(InvalidRequest, match=r"prompt \(1024 tokens\) leaves no room"):
                await c.client.complete("x" * 1024)
            assert len(decode.calls) == 1

    asyncio.run(scenario())


def test_a_value_under_float32s_range_is_judged_as_sent_not_as_zero(frontend):
    # The wire's float32 made top_p=1e-50, in (0, 1], a 0: refused as "got 0.0".
    # Carried as float32's smallest, it keeps the most likely token, as asked.
    from tandem.engine.sampling_params import FLOAT32_TINY

    async def scenario():
        async with cluster(frontend) as c:
            done = await c.client.complete("hi", top_p=1e-50, min_p=1e-50)
            assert done.finish_reason == "length"
            sampling = c.decode[0].calls[-1].request.request.sampling
            assert (sampling.top_p, sampling.min_p) == (FLOAT32_TINY, FLOAT32_TINY)
            # It was a silent 0 (greedy): refused, with the limit and the value it got.
            with pytest.raises(InvalidRequest, match=r"^INVALID_ARGUMENT: temperature must be 0 "
                               r"\(greedy\) or at least 1e-05, got 1\.4\d*e-45$"):  # fmt: skip
                await c.client.complete("hi", temperature=1e-50)

    asyncio.run(scenario())


def test_client_raises_invalid_request_naming_the_field(frontend):
    async def scenario():
        async with cluster(frontend) as c:
            with pytest.raises(InvalidRequest, match=r"^INVALID_ARGUMENT: top_k must be >= 0"):
                await c.client.complete("hi", top_k=-2)
            with pytest.raises(InvalidRequest, match="prompt must not be empty"):
                await c.client.tokenize("")
            assert c.worker_calls() == 0

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_router_reads_a_gguf_without_dequantising_it(tmp_path):
    # A router on a head node with no copy in its cache dequantised the whole model
    # for its tokenizer: minutes, and the model's float32 size, for a 7B.
    from tandem.config import RouterConfig
    from tandem.router.frontend import Frontend

    cache = tmp_path / "cache"
    fresh = Frontend.load(RouterConfig(cache_dir=str(cache)))
    assert not cache.exists() or not any(cache.rglob("*.safetensors"))
    built = Frontend.load(RouterConfig())  # from the dequantised copy the workers load
    try:
        assert (fresh.context_length, fresh.vocab_size) == (built.context_length, built.vocab_size)
        assert fresh.tokenizer.eos_token_ids == built.tokenizer.eos_token_ids
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 👋"}]
        assert fresh.tokenizer.encode_chat(chat) == built.tokenizer.encode_chat(chat)
        assert fresh.tokenizer.encode("café  <|im_end|>\n") == built.tokenizer.encode(
            "café  <|im_end|>\n"
        )
    finally:
        fresh.close()
        built.close()
