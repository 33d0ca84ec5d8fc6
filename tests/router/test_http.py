"""The OpenAI-compatible HTTP API against scripted workers: shapes, errors, keys, cancels.

Driven by the official ``openai`` client where it can be (its parsing of our
bodies is the check), and by plain HTTP (httpx) for what the client hides.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.bench.load.openai_api import OpenAIClient
from tandem.metrics.scrape import scrape, total
from tandem.router.http import protocol
from tests.router.fakes import LENGTH, FakeDecode, FakePrefill, SlowStatus, cluster, wait_until

MODEL = "tiny-random"
CHAT = [{"role": "user", "content": "hi"}]


def run(coro):
    return asyncio.run(coro)


def _client(c, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://{c.router.http_address}/v1",
                              api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)  # fmt: skip


def test_chat_and_completions_have_openai_shapes_streamed_or_not(frontend):
    async def scenario():
        async with cluster(frontend, http_port=0) as c:
            api = _client(c)
            chat = await api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)
            # The fakes' script: the first token 10, then 11, 12, 13, 14 (length).
            assert chat.choices[0].message.content == "<10><11><12><13><14>"
            assert chat.choices[0].finish_reason == "length" and chat.object == "chat.completion"
            assert chat.usage.completion_tokens == 5
            assert chat.usage.total_tokens == chat.usage.prompt_tokens + 5
            assert chat.id.startswith("chatcmpl-") and chat.model == MODEL

            chunks = [
                ch
                async for ch in await api.chat.completions.create(
                    model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}
                )
            ]
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert text == "<10><11><12><13><14>"
            finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
            assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
            assert all("usage" in ch.model_fields_set and ch.usage is None for ch in chunks[:-1])
            assert len({ch.id for ch in chunks}) == 1

            done = await api.completions.create(model=MODEL, prompt="hi", max_tokens=5)
            assert done.object == "text_completion" and done.choices[0].text.startswith("<10>")
            streamed = [ch async for ch in await api.completions.create(
                model=MODEL, prompt="hi", stream=True)]  # fmt: skip
            assert "".join(ch.choices[0].text for ch in streamed) == done.choices[0].text
            assert all(ch.usage is None for ch in streamed)  # no include_usage: no usage chunk

            models = await api.models.list()
            assert [m.id for m in models.data] == [MODEL]
            assert (await api.models.retrieve(MODEL)) == models.data[0]
            with pytest.raises(openai.NotFoundError, match="does not exist"):
                await api.models.retrieve("gpt-9")

    run(scenario())


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        ({"max_tokens": 0}, 400, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({"max_completion_tokens": 0}, 400, "max_completion_tokens",
         "max_completion_tokens must be >= 1"),
        ({"temperature": "hot"}, 400, "temperature", "must be a number"),
        ({"temperature": -1}, 400, "temperature", "temperature"),
        # a huge JSON integer was a 500 (OverflowError), 1e40 was refused as "got inf"
        ({"temperature": 10**400}, 400, "temperature", "must be within float32's range"),
        ({"top_p": 1e40}, 400, "top_p", "must be within float32's range, got 1e+40"),
        # float32 made it 0: refused as "got 0.0", or (temperature) taken as greedy
        ({"top_p": -1e-50}, 400, "top_p", "top_p must be in (0, 1], got -1e-50"),
        ({"temperature": 1e-50}, 400, "temperature", "or at least 1e-05, got 1e-50"),
        ({"top_k": -5}, 400, "top_k", "top_k must be -1 or 0 (off) or at least 1, got -5"),
        ({"n": 2}, 400, "n", "n must be 1"),
        ({"stop": [1]}, 400, "stop", "array of strings"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role",
         "must be one of"),
        ({"messages": []}, 400, "messages", "must not be empty"),
        # no max_tokens sent: the prompt is named, not the server's default limit
        ({"messages": [{"role": "user", "content": "x" * 4096}]}, 400, "messages",
         "leaves no room to generate in the context length 4096"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "messages[0].content[0]", "text part"),
        ({"model": "gpt-9"}, 404, "model", "does not exist"),
        ({"stream": "yes"}, 400, "stream", "must be a boolean"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options",
         "only allowed with stream: true"),
        ({"top_logprobs": 2}, 400, "top_logprobs", "needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "in [0, 20], got 21"),
        # JSON's escapes can spell half a surrogate pair, which no UTF-8 encoder takes.
        ({"messages": [{"role": "user", "content": "ok \ud83d"}]}, 400,
         "messages[0].content", "not valid Unicode: a lone surrogate at character 3"),
        ({"stop": ["a", "\udc00"]}, 400, "stop[1]", "lone surrogate"),
        # Not served: refused rather than ignored (the output would lack what was asked).
        ({"presence_penalty": 1.5}, 400, "presence_penalty", "not supported by this server"),
        ({"logit_bias": {"50256": -100}}, 400, "logit_bias", "not supported"),
        ({"response_format": {"type": "json_object"}}, 400, "response_format", "not supported"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field_in_openais_error_body(frontend, body, status, param, words):
    async def scenario():
        async with cluster(frontend, http_port=0) as c:
            async with httpx.AsyncClient(base_url=f"http://{c.router.http_address}") as http:
                # As JSON escapes ASCII, so that a lone surrogate goes as "\\ud83d".
                sent = json.dumps({"model": MODEL, "messages": CHAT, **body}).encode()
                r = await http.post("/v1/chat/completions", content=sent)
            error = r.json()["error"]
            assert r.status_code == status, r.text
            assert error["param"] == param and words in error["message"], error
            assert set(error) == {"message", "type", "param", "code"}
            assert c.worker_calls() == 0  # nothing reached a worker

    run(scenario())


def test_a_body_past_max_request_bytes_is_413_before_it_is_read_and_odd_bodies_are_400s(
    frontend,
):
    async def scenario():
        async with cluster(frontend, http_port=0, max_request_bytes=4096) as c:
            url = f"http://{c.router.http_address}/v1/completions"
            big = json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode()

            async def chunked():  # no Content-Length: counted as it comes
                for i in range(0, len(big), 1000):
                    yield big[i : i + 1000]

            async with httpx.AsyncClient() as http:
                for content, words in ((big, f"is {len(big)} bytes"), (chunked(), "or more")):
                    r = await http.post(url, content=content)
                    assert r.status_code == 413, r.text
                    assert words in r.json()["error"]["message"]
                    assert "over the limit of 4096 (max_request_bytes)" in r.text
                r = await http.post(url, content=b"[" * 100_000 + b"]" * 100_000)
                assert r.status_code == 413  # the limit first
            assert c.worker_calls() == 0
        async with cluster(frontend, http_port=0) as c:
            url = f"http://{c.router.http_address}/v1/completions"
            async with httpx.AsyncClient() as http:
                r = await http.post(url, content=b"[" * 100_000 + b"]" * 100_000)
            assert (r.status_code, r.json()["error"]["message"]) == (
                400, "the request body nests too deeply"
            )  # fmt: skip
            async with httpx.AsyncClient(base_url=f"http://{c.router.http_address}") as http:
                missing, wrong = await http.get("/v1/nothing"), await http.get("/v1/completions")
            assert missing.status_code == 404
            assert missing.json()["error"]["message"] == "GET /v1/nothing: Not Found"
            assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
            assert wrong.json()["error"]["type"] == "invalid_request_error"

    run(scenario())


def test_a_client_still_sending_a_refused_body_reads_its_413(frontend):
    # Closed at once, the connection was reset under a client still writing, and the
    # reset threw the unread 413 away: urllib saw ECONNRESET every time.
    import urllib.error
    import urllib.request

    def post(url: str, body: bytes) -> int:
        try:
            urllib.request.urlopen(urllib.request.Request(url, body), timeout=20)
        except urllib.error.HTTPError as exc:
            return exc.code
        return 200

    async def scenario():
        async with cluster(frontend, http_port=0) as c:  # 4 MiB
            url = f"http://{c.router.http_address}/v1/completions"
            body = json.dumps({"model": MODEL, "prompt": "x" * (5 << 20)}).encode()
            codes = [await asyncio.to_thread(post, url, body) for _ in range(5)]
            assert codes == [413] * 5
            assert c.worker_calls() == 0

    run(scenario())


def test_a_chat_template_that_refuses_the_messages_is_a_400_and_a_bug_a_json_500(monkeypatch):
    from tandem.config import RouterConfig
    from tandem.router.frontend import Frontend

    frontend = Frontend.load(RouterConfig(model=MODEL))
    frontend.tokenizer.hf_tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{{ messages[0]['content'] }}"
    )

    async def scenario():
        async with cluster(frontend, http_port=0) as c:
            api = _client(c)
            with pytest.raises(openai.BadRequestError) as info:
                await api.chat.completions.create(
                    model=MODEL, messages=[{"role": "system", "content": "be brief"}, *CHAT]
                )
            assert info.value.body["param"] == "messages"
            assert "chat template refuses these messages: System role not supported" in str(
                info.value.body["message"]
            )
            assert c.worker_calls() == 0

            def boom(*args):
                raise KeyError("a bug")

            monkeypatch.setattr(protocol.Shaper, "complete", boom)
            async with httpx.AsyncClient(base_url=f"http://{c.router.http_address}") as http:
                r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
            assert r.status_code == 500
            assert r.json()["error"] == {
                "message": "internal error: KeyError", "type": "server_error", "param": None,
                "code": None,
            }  # fmt: skip

    run(scenario())


def test_statuses_map_overload_to_429_with_retry_after_and_no_worker_to_503(frontend):
    async def scenario():
        gate = asyncio.Event()
        async with cluster(frontend, decode=[FakeDecode(gate=gate)], max_queue=1,
                           http_port=0) as c:  # fmt: skip
            api = _client(c)
            held = asyncio.ensure_future(api.chat.completions.create(model=MODEL, messages=CHAT))
            await wait_until(lambda: c.decode[0].calls, what="the first request in flight")
            with pytest.raises(openai.RateLimitError) as info:
                await api.chat.completions.create(model=MODEL, messages=CHAT)
            assert info.value.response.headers["retry-after"] == "1"
            assert "max_queue=1" in info.value.body["message"]
            gate.set()
            await held
        async with cluster(frontend, decode=[], http_port=0) as c:
            with pytest.raises(openai.InternalServerError) as info:
                await _client(c).chat.completions.create(model=MODEL, messages=CHAT)
            assert info.value.status_code == 503 and "no decode worker" in info.value.message
            async with httpx.AsyncClient(base_url=f"http://{c.router.http_address}") as http:
                assert (await http.get("/health")).status_code == 503  # a pool is empty

    run(scenario())


def test_health_is_503_from_the_start_of_a_drain_as_grpc_health_is_not_serving(frontend):
    # A poll round during the drain set the router ready again: /health answered 200
    # (until uvicorn closed the connection it came on) while gRPC said NOT_SERVING.
    async def scenario():
        decode = SlowStatus(gate=asyncio.Event(), status_delay_s=0)  # counts the polls
        async with cluster(frontend, decode=[decode], http_port=0,
                           status_interval_s=0.02) as c:  # fmt: skip
            url = f"http://{c.router.http_address}/health"
            # What /health answers, with or without a connection to ask it on.
            app = httpx.AsyncClient(transport=httpx.ASGITransport(app=c.router._http.app))
            assert (await app.get(url)).status_code == 200
            held = asyncio.ensure_future(c.client.complete("hello"))
            await wait_until(lambda: decode.calls, what="a stream in flight")
            polls = decode.asked
            stopping = asyncio.ensure_future(c.router.stop(grace=10))
            await wait_until(lambda: decode.asked >= polls + 2, what="a poll round in the drain")
            health = await app.get(url)
            assert (health.status_code, health.json()) == (503, {"status": "unavailable"})
            async with grpc.aio.insecure_channel(c.router.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for service in ("", "tandem.v1.Tandem"):
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(httpx.TransportError):  # and the port takes no new connection
                async with httpx.AsyncClient() as http:
                    await http.get(url)
            decode.gate.set()
            assert (await held).finish_reason == "length"  # the stream in flight finishes
            await stopping
            await app.aclose()

    run(scenario())


def test_a_client_that_disconnects_cancels_the_worker_calls(frontend):
    async def scenario():
        async with cluster(frontend, decode=[FakeDecode(hang=True)], http_port=0) as c:
            async with httpx.AsyncClient(base_url=f"http://{c.router.http_address}") as http:
                body = {"model": MODEL, "messages": CHAT, "stream": True}
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    lines = r.aiter_lines()
                    while "<14>" not in await anext(lines):  # the script's last token
                        pass
                # Closed mid-stream (the fake never finishes): the decode call goes.
                await wait_until(lambda: c.decode[0].calls[0].cancelled_at, what="cancel")
                # Not streamed: the router notices the disconnect while it waits.
                body["stream"] = False
                task = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
                await wait_until(lambda: len(c.decode[0].calls) == 2, what="the second call")
                task.cancel()
                await wait_until(lambda: c.decode[0].calls[1].cancelled_at, what="cancel 2")

    run(scenario())


def test_a_client_that_leaves_before_the_first_token_cancels_its_reservation(frontend):
    async def scenario():
        prefill = FakePrefill(hang=True)  # a busy prefill pool: the first token never comes
        decode = FakeDecode(gate=asyncio.Event())  # holds its reservation open
        async with cluster(frontend, prefill=[prefill], decode=[decode], http_port=0) as c:
            async with httpx.AsyncClient(base_url=f"http://{c.router.http_address}") as http:
                for n, stream in enumerate((True, False), start=1):
                    body = {"model": MODEL, "messages": CHAT, "stream": stream}
                    task = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
                    await wait_until(lambda n=n: len(prefill.calls) == n, what="the prefill")
                    task.cancel()
                    await wait_until(lambda: prefill.calls[-1].cancelled_at, what="prefill gone")
                    # and the decode worker's reservation with it
                    await wait_until(lambda: c.decode[0].calls[-1].cancelled_at,
                                     what="reservation gone")  # fmt: skip

    run(scenario())


def test_api_keys_are_the_routers_and_health_needs_none(frontend, tmp_path):
    key = "k" * 32
    keys = tmp_path / "keys"
    keys.write_text(f"{key} name=app requests_per_s=1000\n")

    async def scenario():
        async with cluster(frontend, api_keys_file=str(keys), http_port=0,
                           connect={"api_key": key}) as c:  # fmt: skip
            with pytest.raises(openai.AuthenticationError) as info:
                await _client(c, api_key="wrong" * 8).models.list()
            assert info.value.body["code"] == "invalid_api_key"
            done = await _client(c, api_key=key).completions.create(model=MODEL, prompt="hi")
            assert done.choices[0].finish_reason == "length"
            async with httpx.AsyncClient(base_url=f"http://{c.router.http_address}") as http:
                assert (await http.get("/health")).json() == {"status": "ok"}
                # The metrics name every worker's address: not for callers without a key.
                assert (await http.get("/metrics")).status_code == 401
                bearer = {"authorization": f"Bearer {key}"}
                metrics = (await http.get("/metrics", headers=bearer)).text
            assert 'tandem_router_requests_total{code="OK"' in metrics

    run(scenario())


def test_listing_the_models_takes_from_the_keys_rate_as_over_grpc(frontend, tmp_path):
    key = "k" * 32
    keys = tmp_path / "keys"
    keys.write_text(f"{key} name=app requests_per_s=1\n")

    async def scenario():
        async with cluster(frontend, api_keys_file=str(keys), http_port=0) as c:
            async with httpx.AsyncClient(base_url=f"http://{c.router.http_address}") as http:
                bearer = {"authorization": f"Bearer {key}"}
                assert (await http.get("/v1/models", headers=bearer)).status_code == 200
                refused = await http.get("/v1/models", headers=bearer)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert "'app' is over its rate limit" in refused.json()["error"]["message"]

    run(scenario())


def test_a_call_over_its_keys_rate_is_refused_before_its_body_is_read(frontend, tmp_path):
    # Each refusal first read and parsed the whole body (up to max_request_bytes): a
    # flood of them took a core of the router. And Retry-After said 1 s, whatever the
    # rate: a client that honoured it was refused again and again.
    key = "k" * 32
    keys = tmp_path / "keys"
    keys.write_text(f"{key} name=app requests_per_s=0.2\n")

    async def scenario():
        async with cluster(frontend, api_keys_file=str(keys), http_port=0,
                           metrics_port=0) as c:  # fmt: skip
            host, port = c.router.http_address.rsplit(":", 1)
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as http:
                bearer = {"authorization": f"Bearer {key}"}
                assert (await http.get("/v1/models", headers=bearer)).status_code == 200
            for path in ("/v1/completions", "/tokenize"):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                             f"{key}\r\nContent-Length: 1000000\r\n\r\n{{".encode())  # fmt: skip
                status = await asyncio.wait_for(reader.readline(), 5)  # the body never comes
                assert status.startswith(b"HTTP/1.1 429"), status
                head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).lower()
                assert b"retry-after: 5\r\n" in head
                writer.close()
            samples = await asyncio.to_thread(scrape, c.router.metrics_address)
        # Both refusals counted; only the generation is a request.
        assert total(samples, "tandem_router_admission_rejections_total", reason="key_rate") == 2
        assert total(samples, "tandem_router_requests_total", code="RESOURCE_EXHAUSTED") == 1

    run(scenario())


def test_a_failure_after_the_first_token_ends_the_stream_with_an_error_event(frontend):
    async def scenario():
        decode = FakeDecode(fail_with=grpc.StatusCode.INTERNAL, chunks=[([11], 0)])
        async with cluster(frontend, prefill=[FakePrefill()], decode=[decode],
                           http_port=0) as c:  # fmt: skip
            async with httpx.AsyncClient(base_url=f"http://{c.router.http_address}") as http:
                body = {"model": MODEL, "prompt": "hi", "stream": True}
                r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200  # the stream had started
            events = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert "scripted failure" in error["message"] and error["code"] == "internal"

    run(scenario())


def test_with_the_public_ports_tls_and_client_ca_only_a_member_is_served(frontend, certs):
    settings = dict(tls_cert_file=certs.router_cert, tls_key_file=certs.router_key,
                    tls_client_ca_file=certs.ca)  # fmt: skip

    async def scenario():
        async with cluster(frontend, http_port=0, connect={"ca_file": certs.ca,
                           "cert_file": certs.client_cert, "key_file": certs.client_key},
                           **settings) as c:  # fmt: skip
            url = f"https://{c.router.http_address}"
            member = httpx.AsyncClient(base_url=url, verify=_context(certs, client=True))
            async with member:
                r = await member.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
                assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
            # The load harness's client, with the connection flags of the gRPC one.
            async with OpenAIClient(c.router.http_address, ca_file=certs.ca,
                                    cert_file=certs.client_cert,
                                    key_file=certs.client_key) as harness:  # fmt: skip
                assert (await harness.model_info()).model_id == MODEL
            stranger = httpx.AsyncClient(base_url=url, verify=_context(certs, client=False))
            async with stranger:
                with pytest.raises(httpx.HTTPError):  # the handshake refuses it
                    await stranger.get("/v1/models")

    run(scenario())


def _context(certs, client: bool):
    import ssl

    context = ssl.create_default_context(cafile=certs.ca)
    if client:
        context.load_cert_chain(certs.client_cert, certs.client_key)
    return context


def test_logprobs_of_tokens_inside_a_character_carry_its_bytes_and_offsets(frontend):
    from tandem._proto.tandem.v1 import tandem_pb2

    tok = frontend.tokenizer
    ids = tok.encode("aé€b")  # tiny-random's tokens are single bytes: é and € split
    logprobs = [tandem_pb2.TokenLogprob(token_id=i, logprob=-1.0) for i in ids]
    parsed = protocol.parse({"model": MODEL, "prompt": "x", "logprobs": 0}, False, MODEL)
    shaper = protocol.Shaper(parsed, MODEL, tok)
    # Two chunks, as the engine streams them: é's first byte is held back with its text.
    first = shaper.logprobs(logprobs[:2], "a", final=False)
    rest = shaper.logprobs(logprobs[2:], "é€b")
    tokens = first["tokens"] + rest["tokens"]
    assert tokens == ["a", "bytes:\\xc3", "bytes:\\xa9", "bytes:\\xe2", "bytes:\\x82",
                      "bytes:\\xac", "b"]  # fmt: skip
    # Characters before each token: a character counts once its last byte has come.
    assert first["text_offset"] + rest["text_offset"] == [0, 1, 1, 2, 2, 2, 3]
    chat = protocol.Shaper(protocol.parse({"model": MODEL, "messages": CHAT}, True, MODEL),
                           MODEL, tok).logprobs(logprobs)  # fmt: skip
    assert b"".join(bytes(e["bytes"]) for e in chat["content"]) == "aé€b".encode()


def test_a_top_p_under_float32s_range_is_served_not_refused_as_zero(frontend):
    # top_p=1e-50 is in (0, 1], but float32 made it 0: "top_p must be in (0, 1], got 0.0".
    from tandem.engine.sampling_params import FLOAT32_TINY

    async def scenario():
        async with cluster(frontend, http_port=0) as c:
            async with httpx.AsyncClient(base_url=f"http://{c.router.http_address}") as http:
                body = {"model": MODEL, "prompt": "hi", "top_p": 1e-50, "max_tokens": 5}
                r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert c.decode[0].calls[-1].request.request.sampling.top_p == FLOAT32_TINY

    run(scenario())


def test_an_event_is_one_line_to_a_client_that_splits_at_unicode_line_breaks():
    # JSON leaves U+2028, U+2029 and U+0085 unescaped in a string: an answer holding one
    # cut the event in two for a client reading lines with str.splitlines() (httpx's
    # aiter_lines), which then failed on half a JSON object.
    from tandem.router.http.server import _sse

    event = {"choices": [{"text": "a\u2028b\u2029c\x85d é"}]}
    line, *rest = _sse(event).splitlines()
    assert rest == [""] and json.loads(line.removeprefix("data: ")) == event
    assert "é" in line  # the rest stays as it is


def test_text_offsets_stay_in_the_text_a_stop_string_cut(frontend):
    # Every token sampled is listed, those of the stop string too, but the offsets
    # went on counting their characters: past the end of the text the client got.
    from tandem._proto.tandem.v1 import tandem_pb2
    from tandem.engine.tokenizer import IncrementalDetokenizer, StopStringMatcher
    from tandem.router.http.server import _events

    tok = frontend.tokenizer
    ids = tok.encode("xyABC")  # tiny-random's tokens are single bytes
    detok, stops = IncrementalDetokenizer(tok), StopStringMatcher(["ABC"])
    responses = [  # as the engine streams them: A and B held back, C ends the stop
        tandem_pb2.GenerateResponse(
            text=stops.push(detok.add(i))[0],
            logprobs=[tandem_pb2.TokenLogprob(token_id=i, logprob=-1.0 - i)],
        )
        for i in ids
    ]
    responses[-1].finish_reason = tandem_pb2.FINISH_REASON_STOP
    assert [r.text for r in responses] == ["x", "y", "", "", ""]

    def shaper():
        parsed = protocol.parse({"model": MODEL, "prompt": "p", "logprobs": 0}, False, MODEL)
        return protocol.Shaper(parsed, MODEL, tok)

    whole = shaper().complete("xy", tandem_pb2.FINISH_REASON_STOP, tandem_pb2.Usage(),
                              [lp for r in responses for lp in r.logprobs])  # fmt: skip
    logprobs = whole["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["x", "y", "A", "B", "C"]
    assert logprobs["token_logprobs"] == [-1.0 - i for i in ids]
    assert logprobs["text_offset"] == [0, 1, 2, 2, 2]  # A, B and C start where "xy" ends

    async def stream():
        async def rest():
            for r in responses[1:]:
                yield r

        return [e async for e in _events(responses[0], rest(), shaper(), False)]

    events = [json.loads(e.removeprefix("data: ")) for e in run(stream())[:-1]]
    choices = [e["choices"][0] for e in events]
    assert "".join(c["text"] for c in choices) == "xy"
    # A's offset (2) is inside what was sent by then; B's (3) was not: it waited, and
    # came with C at the end, where the stop string cut them both.
    assert [c["logprobs"]["text_offset"] for c in choices] == [[0], [1], [2], [2, 2]]
    assert [t for c in choices for t in c["logprobs"]["tokens"]] == ["x", "y", "A", "B", "C"]
    assert choices[-1]["finish_reason"] == "stop"


def test_special_tokens_in_logprobs_are_named_apart(frontend):
    # Each special token stands for no bytes: named by its bytes, <|im_end|> and
    # <|endoftext|> were both "", and the completions API's dict of alternatives,
    # keyed by name, kept one of the two.
    from tandem._proto.tandem.v1 import tandem_pb2

    tok = frontend.tokenizer
    end, text = tok.encode("<|im_end|>") + tok.encode("<|endoftext|>")
    top = [tandem_pb2.TopLogprob(token_id=i, logprob=-1.0 - i) for i in (end, text)]
    logprobs = [tandem_pb2.TokenLogprob(token_id=end, logprob=-1.0, top=top)]
    parsed = protocol.parse({"model": MODEL, "prompt": "x", "logprobs": 2}, False, MODEL)
    legacy = protocol.Shaper(parsed, MODEL, tok).logprobs(logprobs)
    assert legacy["tokens"] == ["<|im_end|>"]
    assert legacy["top_logprobs"] == [{"<|im_end|>": -1.0 - end, "<|endoftext|>": -1.0 - text}]
    assert legacy["text_offset"] == [0]  # no characters
    chat = protocol.Shaper(protocol.parse({"model": MODEL, "messages": CHAT}, True, MODEL),
                           MODEL, tok).logprobs(logprobs)  # fmt: skip
    entry = chat["content"][0]
    assert (entry["token"], entry["bytes"]) == ("<|im_end|>", [])
    assert [t["token"] for t in entry["top_logprobs"]] == ["<|im_end|>", "<|endoftext|>"]


def test_unserved_options_at_their_neutral_values_are_accepted():
    from tandem.router.http import protocol

    body = {"model": MODEL, "prompt": "hi", "presence_penalty": 0, "frequency_penalty": 0.0,
            "logit_bias": {}, "best_of": 1, "echo": False, "response_format": {"type": "text"},
            "tools": [], "user": "u-1", "some_future_field": 7, "min_tokens": 0,
            "stop_token_ids": [], "guided_json": None}  # fmt: skip
    assert protocol.parse(body, chat=False, model_id=MODEL).request.prompt == "hi"
    # vLLM's fields that would change the output were ignored: the text came without them.
    for field, value in (("min_tokens", 5), ("stop_token_ids", [2]), ("bad_words", ["x"]),
                         ("allowed_token_ids", [1]), ("guided_choice", ["a", "b"]),
                         ("structured_outputs", {"json": {}}), ("skip_special_tokens", False),
                         ("include_stop_str_in_output", True), ("truncate_prompt_tokens", 5),
                         ("continue_final_message", True)):  # fmt: skip
        with pytest.raises(protocol.ApiError, match=f"{field} is not supported") as err:
            protocol.parse({**body, field: value}, chat=False, model_id=MODEL)
        assert err.value.param == field


def test_either_name_of_the_token_limit_is_taken_by_either_api():
    # /v1/completions dropped max_completion_tokens and generated the default 256.
    from tandem.router.http import protocol

    hi = {"role": "user", "content": "hi"}
    for chat, text in ((False, {"prompt": "hi"}), (True, {"messages": [hi]})):
        body = {"model": MODEL, **text, "max_completion_tokens": 3}
        assert protocol.parse(body, chat=chat, model_id=MODEL).request.sampling.max_tokens == 3


def test_a_connection_whose_request_does_not_arrive_in_time_is_closed(frontend, monkeypatch):
    # Nothing, half a header, or half a body: each was held for good, a descriptor of
    # the whole router apiece (enough of them and gRPC and /health failed too).
    from tandem.router.http import server

    monkeypatch.setattr(server, "REQUEST_TIMEOUT_S", 0.5)

    async def scenario():
        gate = asyncio.Event()
        gate.set()
        async with cluster(frontend, decode=[FakeDecode(gate=gate)], http_port=0) as c:
            host, port = c.router.http_address.rsplit(":", 1)
            body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                    f"{len(body)}\r\n\r\n").encode()  # fmt: skip
            for sent in (b"", head[:20], head + body[:5]):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(sent)
                assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, no reply
                writer.close()
            # A request all in is answered however long its answer takes: kept alive,
            # with Connection: close, or over HTTP/1.0 (nginx's proxy_pass, urllib).
            for version, close in (("1.1", False), ("1.1", True), ("1.0", False)):
                gate.clear()
                reader, writer = await asyncio.open_connection(host, int(port))
                whole = head.replace(b"HTTP/1.1", f"HTTP/{version}".encode())
                if close:
                    whole = whole.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
                writer.write(whole + body)
                await asyncio.sleep(1.0)
                gate.set()
                status = await asyncio.wait_for(reader.readline(), 10)  # HTTP/1.1 either way
                assert status.startswith(b"HTTP/1.1 200"), (version, close, status)
                writer.close()

    run(scenario())


def test_a_streaming_client_that_stops_reading_is_let_go(frontend, caplog):
    # It held its place in max_queue (and its key's max_streams) for as long as it
    # kept its connection open: four such clients and every other caller got 429s.
    bulk = FakeDecode(chunks=[([11], 0)] * 3000 + [([14], LENGTH)], text_padding=1000)

    async def scenario():
        async with cluster(frontend, decode=[bulk], http_port=0,
                           stream_stall_timeout_s=1.0) as c:  # fmt: skip
            host, port = c.router.http_address.rsplit(":", 1)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            reader, writer = await asyncio.open_connection(sock=sock)
            body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3002,
                               "stream": True}).encode()  # fmt: skip
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                         f"{len(body)}\r\n\r\n".encode() + body)  # fmt: skip
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            await wait_until(lambda: c.router.admission.in_flight == 0, timeout=20,
                             what="the stalled stream let go")  # fmt: skip
            writer.close()

    with caplog.at_level(logging.INFO, logger="tandem.router.http.server"):
        run(scenario())
    assert "took nothing for 1 s (stream_stall_timeout_s)" in caplog.text


def test_an_answers_tail_that_the_client_does_not_take_is_not_held_for_good():
    # A client that stopped reading near the end of its answer: the tail waited in the
    # router's buffer under the high-water mark, so pause_writing never armed the stall
    # timer, and the keep-alive close() waited to send it for as long as the client
    # kept its socket open (240 s and on, with stream_stall_timeout_s 5).
    from tandem.router.http.server import _Protocol

    class Transport:
        left, aborted = 1000, False

        def get_write_buffer_size(self) -> int:
            return self.left

        def abort(self) -> None:
            self.aborted = True

    async def scenario():
        protocol = _Protocol.__new__(_Protocol)
        protocol.loop, protocol.stall_timeout_s = asyncio.get_running_loop(), 0.2
        protocol.transport = stuck = Transport()
        protocol._watch_tail(stuck.left)
        await asyncio.sleep(0.5)
        assert stuck.aborted
        protocol.transport = slow = Transport()
        protocol._watch_tail(slow.left)
        for left in (600, 200, 0):  # it takes some in each period: watched, then done
            await asyncio.sleep(0.15)
            slow.left = left
        await asyncio.sleep(0.5)
        assert not slow.aborted and protocol._stall is None

    run(scenario())


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_client_that_hangs_up_mid_upload_is_a_499_not_a_500(frontend, path):
    # It was an internal error, with uvicorn's 46-line traceback in the router's log.
    async def scenario():
        async with cluster(frontend, http_port=0) as c:
            messages = [{"type": "http.request", "body": b'{"mod', "more_body": True},
                        {"type": "http.disconnect"}]  # fmt: skip
            sent = []

            async def receive():
                return messages.pop(0)

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "method": "POST", "path": path,
                     "raw_path": path.encode(), "root_path": "", "query_string": b"",
                     "headers": [], "http_version": "1.1", "scheme": "http",
                     "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2)}  # fmt: skip
            await c.router._http.app(scope, receive, send)
            assert sent[0]["status"] == 499 and c.worker_calls() == 0

    run(scenario())


def test_connections_past_the_cap_are_closed_at_once(frontend, monkeypatch):
    from tandem.router.http import server

    monkeypatch.setattr(server, "connection_cap", lambda share: 2)

    async def scenario():
        async with cluster(frontend, http_port=0) as c:
            host, port = c.router.http_address.rsplit(":", 1)
            held = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
            await asyncio.sleep(0.1)
            reader, writer = await asyncio.open_connection(host, int(port))
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            for _, w in held:
                w.close()
            async with httpx.AsyncClient() as http:  # room again once they have gone
                await asyncio.sleep(0.1)
                r = await http.get(f"http://{c.router.http_address}/health")
                assert r.status_code == 200

    run(scenario())


def test_tls_sockets_count_against_the_cap_before_their_handshake_and_it_has_a_deadline(
    frontend, certs, monkeypatch
):
    # asyncio calls a TLS server's protocol only once the handshake is done, and waits
    # 60 s for one: sockets that never sent a ClientHello were past the cap and the
    # request timeout, and a client with no credentials took every descriptor of the
    # router process, the gRPC port's too.
    from tandem.router.http import server

    monkeypatch.setattr(server, "connection_cap", lambda share: 4)
    monkeypatch.setattr(server, "HANDSHAKE_TIMEOUT_S", 1.0)
    settings = dict(tls_cert_file=certs.router_cert, tls_key_file=certs.router_key)

    async def scenario():
        async with cluster(frontend, http_port=0, connect={"ca_file": certs.ca},
                           **settings) as c:  # fmt: skip
            host, port = c.router.http_address.rsplit(":", 1)
            silent = [await asyncio.open_connection(host, int(port)) for _ in range(4)]
            await asyncio.sleep(0.2)
            reader, writer = await asyncio.open_connection(host, int(port))
            assert await asyncio.wait_for(reader.read(), 5) == b""  # past the cap: closed
            writer.close()
            for reader, _ in silent:  # each closed at its handshake's deadline
                assert await asyncio.wait_for(reader.read(), 5) == b""
            url = f"https://{c.router.http_address}"
            async with httpx.AsyncClient(base_url=url, verify=_context(certs, False)) as http:
                assert (await http.get("/health")).status_code == 200  # room again
            assert not c.router._http._protocol.handshakes

    run(scenario())


def _tls_request_with_finished(certs, host: str, port: int, request: bytes) -> bytes:
    """A TLS client whose request goes out in the same write as its Finished (curl's
    and asyncio's way); what came back before the server closed or 5 s passed."""
    import ssl

    tls = ssl.create_default_context(cafile=certs.ca).wrap_bio(
        incoming := ssl.MemoryBIO(), outgoing := ssl.MemoryBIO(), server_hostname="127.0.0.1"
    )
    with socket.create_connection((host, port), timeout=5) as sock:
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(outgoing.read())
                incoming.write(sock.recv(65536))
        tls.write(request)
        sock.sendall(outgoing.read())  # Finished + the request, one write
        got = b""
        with contextlib.suppress(OSError, ssl.SSLError):
            while b"\r\n\r\n" not in got and (data := sock.recv(65536)):
                incoming.write(data)
                with contextlib.suppress(ssl.SSLWantReadError):
                    got += tls.read(65536)
        return got


def test_a_request_that_comes_with_the_tls_finished_is_answered(frontend, certs):
    # TLS passes such a request up as the handshake ends, before the connection is
    # made: h11 parsed it with no transport, and the client got nothing (curl, every
    # time).
    settings = dict(tls_cert_file=certs.router_cert, tls_key_file=certs.router_key)

    async def scenario():
        async with cluster(frontend, http_port=0, connect={"ca_file": certs.ca},
                           **settings) as c:  # fmt: skip
            host, port = c.router.http_address.rsplit(":", 1)
            request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            for _ in range(3):
                got = await asyncio.to_thread(
                    _tls_request_with_finished, certs, host, int(port), request
                )
                assert got.startswith(b"HTTP/1.1 200"), got

    run(scenario())


def test_a_tls_handshake_under_way_when_the_router_stops_is_not_served(frontend, certs):
    # uvicorn tells the connections it has to finish once, as its stop begins: one
    # whose handshake ended later was kept open past the stop, and still answered.
    import ssl

    settings = dict(tls_cert_file=certs.router_cert, tls_key_file=certs.router_key)

    def handshake(raw):
        context = ssl.create_default_context(cafile=certs.ca)
        with pytest.raises((ssl.SSLError, OSError)):
            context.wrap_socket(raw, server_hostname="127.0.0.1").sendall(b"GET / HTTP/1.1")

    async def scenario():
        decode = FakeDecode(gate=asyncio.Event())  # a request in flight holds the grace
        async with cluster(frontend, decode=[decode], http_port=0,
                           connect={"ca_file": certs.ca}, **settings) as c:  # fmt: skip
            host, port = c.router.http_address.rsplit(":", 1)
            url, verify = f"https://{c.router.http_address}", _context(certs, False)
            async with httpx.AsyncClient(base_url=url, verify=verify, timeout=20) as http:
                held = asyncio.create_task(
                    http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
                )
                await wait_until(lambda: decode.calls, what="the request placed")
                raw = socket.create_connection((host, int(port)), timeout=5)
                await asyncio.sleep(0.2)  # accepted: its handshake is under way
                stopping = asyncio.create_task(c.router.stop(grace=5))
                await asyncio.sleep(0.3)
                await asyncio.to_thread(handshake, raw)  # refused, though in the grace
                raw.close()
                decode.gate.set()
                assert (await held).status_code == 200  # what was in flight finished
                await stopping

    run(scenario())


def test_a_large_body_is_parsed_off_the_event_loop(frontend, monkeypatch):
    # A few MiB of small JSON values took the loop that every stream shares for a
    # second or two (json.loads, then the check of every string).
    import threading

    from tandem.router.http import server

    parse, build, where = server._parse, protocol.parse, []

    def spy(raw):
        where.append(threading.current_thread() is threading.main_thread())
        return parse(raw)

    def spy_build(*args):  # the body mapped into a request, on the same thread
        where.append(threading.current_thread() is threading.main_thread())
        return build(*args)

    monkeypatch.setattr(server, "_parse", spy)
    monkeypatch.setattr(protocol, "parse", spy_build)

    async def scenario():
        async with cluster(frontend, http_port=0) as c, httpx.AsyncClient() as http:
            url = f"http://{c.router.http_address}/v1/completions"
            for filler in (0, 100_000):
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": "u" * filler}
                assert (await http.post(url, json=body, timeout=30)).status_code == 200

    run(scenario())
    assert where == [True, True, False, False]  # the small one inline, the large one not


def test_retry_after_of_a_rate_too_low_to_count_is_a_day_not_a_500():
    import math

    from tandem.router.http import server

    wait = math.inf  # TokenBucket's wait at key_requests_per_s: 1e-320
    refusal = protocol.ApiError(429, "over the rate", retry_after_s=wait)
    assert server._error(refusal).headers["Retry-After"] == "86400"


def test_counts_are_checked_before_a_request_is_built_from_them():
    # 100,000 tiny messages were mapped into a request before max_chat_messages
    # refused them: 0.2 s of the loop that every stream shares.
    from tandem.router.limits import InputLimits

    limits = InputLimits(1000, max_chat_messages=4, max_stop_strings=2, max_stop_chars=8)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 4 + [7]}
    with pytest.raises(protocol.ApiError, match="messages must be at most 4 messages, got 5"):
        protocol.parse(chat, True, MODEL, limits)
    with pytest.raises(protocol.ApiError, match=r"messages\[4\] must be an object"):
        protocol.parse(chat, True, MODEL)  # (what building them found first)
    stops = {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c"]}
    with pytest.raises(protocol.ApiError, match="stop must be at most 2 strings, got 3") as err:
        protocol.parse(stops, False, MODEL, limits)
    assert err.value.param == "stop"


def test_requests_the_http_layer_refuses_are_counted_as_grpcs_are(frontend):
    # Refused before the gateway (not JSON, a wrong type, another model), they never
    # reached the router's request counter, so no dashboard saw them.
    from tandem.metrics.scrape import scrape, total

    async def scenario():
        async with cluster(frontend, http_port=0, metrics_port=0) as c, httpx.AsyncClient() as h:
            url = f"http://{c.router.http_address}/v1/completions"
            for content, status in ((b"{nope", 400), (b'{"model": "other", "prompt": "hi"}', 404),
                                    (b'{"model": "tiny-random", "prompt": 7}', 400),
                                    (b'{"model": "tiny-random", "prompt": "hi", "max_tokens": 0}',
                                     400)):  # fmt: skip
                assert (await h.post(url, content=content)).status_code == status
            samples = await asyncio.to_thread(scrape, c.router.metrics_address)
        name = "tandem_router_requests_total"
        assert total(samples, name, code="INVALID_ARGUMENT") == 3  # the last by the gateway
        assert total(samples, name, code="NOT_FOUND") == 1

    run(scenario())
