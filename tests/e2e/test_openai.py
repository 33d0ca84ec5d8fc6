"""The OpenAI-compatible API of a real cluster, driven by the official ``openai`` client.

tiny-random, 1 prefill + 1 decode worker as processes; the router serves gRPC
and HTTP. Greedy text and usage through HTTP equal the gRPC API's.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from tandem.client import TandemClient
from tandem.config import EngineConfig, RouterConfig
from tandem.deploy.local import ClusterConfig, LocalCluster
from tandem.router.http import protocol
from tests.e2e.test_cluster import _assert_no_blocks_used

MODEL = "tiny-random"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = ClusterConfig(
        engine=EngineConfig(model=MODEL, dtype="float32", num_blocks=256),
        threads_per_worker=1,
        router=RouterConfig(port=0, http_port=0, max_queue=2),
    )
    with LocalCluster(config, tmp_path_factory.mktemp("openai")) as c:
        yield c


def _api(c: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{c.http_address}/v1", api_key="-", max_retries=0)


def _grpc(c: LocalCluster, **kw):
    with TandemClient(c.address, timeout=60) as client:
        return client.complete(temperature=0, **kw)


def test_greedy_chat_and_completions_equal_the_grpc_api_streamed_or_not(cluster):
    api = _api(cluster)
    want = _grpc(cluster, messages=CHAT, max_tokens=12)
    chat = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == want.text
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (
        want.usage.prompt_tokens, want.usage.completion_tokens)  # fmt: skip
    stream = api.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens

    raw = _grpc(cluster, prompt="Once upon a time", max_tokens=10, ignore_eos=True)
    done = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10,
                                  temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert done.choices[0].text == raw.text and done.usage.completion_tokens == 10
    assert done.choices[0].finish_reason == "length"
    _assert_no_blocks_used(cluster)


def test_the_async_client_streams_and_seeded_sampling_repeats(cluster):
    async def scenario():
        api = openai.AsyncOpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="-",
                                 max_retries=0)  # fmt: skip
        kw = dict(model=MODEL, prompt="The sea", max_tokens=8, temperature=0.8, seed=7)
        first = await api.completions.create(**kw)
        parts = [c.choices[0].text async for c in await api.completions.create(**kw, stream=True)]
        assert "".join(parts) == first.choices[0].text
        await api.close()

    asyncio.run(scenario())


def test_a_stream_closed_mid_way_frees_its_kv_blocks_at_once(cluster):
    api = _api(cluster)
    stream = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2000,
                                         stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    # The ceiling only guards against a hang; on an idle machine it takes milliseconds.
    _assert_no_blocks_used(cluster, within_s=5.0)


def test_overload_is_429_and_a_bad_request_is_400_naming_the_field(cluster):
    api = _api(cluster)
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, messages=CHAT, top_p=0)
    assert info.value.body["param"] == "top_p"
    held = [api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2000,
                                        stream=True, extra_body={"ignore_eos": True})
            for _ in range(2)]  # max_queue=2  # fmt: skip
    for stream in held:
        next(iter(stream))
    with pytest.raises(openai.RateLimitError):
        api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    for stream in held:
        stream.close()
    _assert_no_blocks_used(cluster, within_s=5.0)


def test_logprobs_through_both_apis_are_the_same_and_greedy_picks_the_maximum(cluster):
    with TandemClient(cluster.address, timeout=60) as client:
        want = client.complete(messages=CHAT, max_tokens=8, temperature=0, logprobs=3)
    assert len(want.logprobs) == len(want.token_ids) > 0
    assert [lp.token_id for lp in want.logprobs] == list(want.token_ids)
    api = _api(cluster)
    chat = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == len(want.logprobs)
    for entry, ours in zip(content, want.logprobs, strict=True):
        assert entry.logprob == pytest.approx(ours.logprob, abs=1e-5)
        assert len(entry.top_logprobs) == 3
        best = max(t.logprob for t in entry.top_logprobs)
        assert entry.logprob == pytest.approx(best, abs=1e-6)  # greedy: the maximum
        assert entry.token == protocol.token_text(bytes(entry.bytes))
    # A token may hold part of a UTF-8 character (this model writes random bytes): the
    # bytes, not the tokens' texts, add up to the text.
    joined = b"".join(bytes(entry.bytes) for entry in content)
    assert joined.decode("utf-8", "replace") == chat.choices[0].message.content
    stream = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                    temperature=0, logprobs=2, stream=True,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    tokens = [t for c in stream if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert len(tokens) == 6 and all(t <= 0 for t in tokens)
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=21)
    assert info.value.body["param"] == "top_logprobs"
