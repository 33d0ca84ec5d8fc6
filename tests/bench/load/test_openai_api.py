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
