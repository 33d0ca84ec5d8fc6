"""The harness's OpenAI-API client against a scripted HTTP server (httpx's mock)."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from tandem.bench.load.openai_api import OpenAIClient
from tandem.client.errors import TandemClientError


def test_timeout_is_the_whole_requests_deadline_as_over_grpc():
    # A stream that never pauses for long: httpx's own timeout (per wait) never fires.
    async def events():
        for i in range(20):
            await asyncio.sleep(0.05)
            chunk = {"choices": [{"text": f"t{i}", "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=events())

    async def scenario():
        client = OpenAIClient("http://fake", timeout=0.3)
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                         base_url="http://fake")  # fmt: skip
        texts = []
        with pytest.raises(TandemClientError) as info:
            async for chunk in client.generate("hi", max_tokens=20):
                texts.append(chunk.text)
        await client._http.aclose()
        return info.value, texts

    error, texts = asyncio.run(scenario())
    assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "longer than its 0.3 s timeout" in error.details
    assert 3 <= len(texts) < 20


def test_an_answer_with_unicode_line_separators_is_one_event_not_a_failure():
    # Valid SSE and JSON carry U+2028, U+2029 and U+0085 unescaped inside an event; the
    # client split lines at them too (httpx's aiter_lines) and failed on half an event.
    text = "a\u2028b\u2029c\x85d"
    chunk = {"choices": [{"text": text, "finish_reason": "stop"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}}
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\r\n\r\n" for e in (chunk, usage))
    pieces = [p.encode() for p in (body[:9], body[9:40], body[40:]) + ("data: [DONE]\n\n",)]

    async def events():
        for piece in pieces:  # an event cut anywhere across reads
            yield piece

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=events())

    async def scenario():
        client = OpenAIClient("http://fake", timeout=5)
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                         base_url="http://fake")  # fmt: skip
        chunks = [c async for c in client.generate("hi", max_tokens=4)]
        await client._http.aclose()
        return chunks

    chunks = asyncio.run(scenario())
    assert "".join(c.text for c in chunks) == text
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].finish_reason == "stop"


def test_connection_flags_are_those_of_the_tandem_client():
    # They were dropped: --tls still spoke http://, and the key went in clear.
    from tandem.errors import ConfigError

    async def scenario():
        with pytest.raises(ConfigError, match="refusing to send an API key in clear"):
            OpenAIClient("192.0.2.2:8000", api_key="k" * 20)
        with pytest.raises(ConfigError, match="refusing"):
            OpenAIClient("192.0.2.2:8000", environ={"TANDEM_API_KEY": "k" * 20})
        with pytest.raises(ConfigError, match="says http://"):
            OpenAIClient("HTTP://192.0.2.2:8000", tls=True)
        with pytest.raises(ConfigError, match="both cert_file and key_file"):
            OpenAIClient("192.0.2.2:8000", cert_file="c.pem")
        secure = OpenAIClient("192.0.2.2:8000/v1", tls=True, api_key="k" * 20)
        local = OpenAIClient("127.0.0.1:8000", environ={"TANDEM_API_KEY": "from-env"})
        async with secure, local:
            assert secure.root == "https://192.0.2.2:8000"
            assert secure._http.headers["authorization"] == "Bearer " + "k" * 20
            assert local.root == "http://127.0.0.1:8000"
            assert local._http.headers["authorization"] == "Bearer from-env"

    asyncio.run(scenario())
