"""``tandem bench load --api openai``: the harness against any OpenAI-compatible server.

``OpenAIClient`` answers the three calls the harness makes of a Tandem client
(``model_info``, ``tokenize``, ``generate``) over HTTP, so the same datasets,
arrivals, timings and report measure Tandem's HTTP API, vLLM, SGLang or any
other such server. Plain streamed HTTP (httpx), not the ``openai`` package: the
harness times bytes as they arrive, with no object model in between.

- ``generate``: ``/v1/completions`` for a prompt, ``/v1/chat/completions`` for
  messages; always streamed, with ``stream_options.include_usage`` for the server's
  token counts, ``ignore_eos`` (a vLLM extension Tandem honours too) so that output
  lengths are the dataset's. Each event with text counts as one token arriving.
- ``tokenize``: ``POST /tokenize`` (vLLM's and Tandem's) when the server has it;
  otherwise a one-token completion whose usage gives the prompt's count.
- ``model_info``: the first model of ``/v1/models`` (``max_model_len`` where the
  server says it; otherwise no context limit is checked here).

HTTP statuses become the gRPC status names the report counts failures by (429
RESOURCE_EXHAUSTED, 503 UNAVAILABLE, 400 INVALID_ARGUMENT, ...).
"""

from __future__ import annotations

import json
import os
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import grpc
import httpx

from tandem.client._connect import checked_api_key
from tandem.client.errors import TandemClientError
from tandem.client.types import ModelInfo, Usage
from tandem.errors import ConfigError

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
          504: grpc.StatusCode.DEADLINE_EXCEEDED}  # fmt: skip
NO_LIMIT = 2**31 - 1


@dataclass
class Chunk:
    """What the harness reads of a streamed response (as tandem.client's chunks)."""

    token_ids: tuple[int, ...]  # one placeholder per event with text: ids are not sent
    usage: Usage | None = None
    finish_reason: str | None = None
    text: str = ""


class OpenAIClient:
    def __init__(
        self,
        target: str,
        timeout: float = 300.0,
        *,
        tls: bool | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        api_key: str | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        """The connection flags as ``TandemClient``'s (tandem/client/flags.py): TLS when
        ``tls`` or any file is given (or the target says https://), the key from
        ``api_key`` or $TANDEM_API_KEY, never sent in clear off this machine."""
        if bool(cert_file) != bool(key_file):
            raise ConfigError("a client certificate needs both cert_file and key_file")
        secure = bool(tls or ca_file or cert_file)
        scheme, sep, rest = target.partition("://")
        scheme = scheme.lower()
        if not sep:
            scheme, rest = ("https" if secure else "http"), target
        elif scheme == "http" and secure:
            raise ConfigError(f"TLS was asked for, but the target {target} says http://")
        secure = scheme == "https"
        self.root = f"{scheme}://{rest}".rstrip("/").removesuffix("/v1")
        key = checked_api_key(urlsplit(self.root).netloc, api_key, secure, environ)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        verify: ssl.SSLContext | bool = True
        if secure:
            verify = ssl.create_default_context(cafile=ca_file)
            if cert_file:
                verify.load_cert_chain(cert_file, key_file)
        self._http = httpx.AsyncClient(
            base_url=self.root, headers=headers, timeout=httpx.Timeout(timeout),
            verify=verify, limits=httpx.Limits(max_connections=None),
        )  # fmt: skip
        self.timeout = timeout
        self.model = ""
        self._tokenize_endpoint = True

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self._http.aclose()

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        try:
            r = await self._http.get("/v1/models", timeout=timeout)
        except httpx.HTTPError as exc:
            raise TandemClientError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        _raise_for(r)
        data = r.json().get("data") or []
        if not data:
            raise TandemClientError(grpc.StatusCode.NOT_FOUND, f"{self.root} serves no model")
        self.model = data[0]["id"]
        return ModelInfo(self.model, int(data[0].get("max_model_len") or NO_LIMIT), 0)

    async def tokenize(self, prompt: str | None = None, messages=None) -> list[int]:
        body = {"model": self.model, **({"prompt": prompt} if messages is None
                                        else {"messages": messages})}  # fmt: skip
        if self._tokenize_endpoint:
            r = await self._http.post("/tokenize", json=body)
            if r.status_code == 200:
                return r.json()["tokens"]
            if r.status_code not in (404, 405):
                _raise_for(r)
            self._tokenize_endpoint = False  # not this server's: count by usage instead
        usage = None
        async for chunk in self.generate(prompt, messages=messages, max_tokens=1):
            usage = chunk.usage or usage
        if usage is None:
            raise TandemClientError(grpc.StatusCode.UNKNOWN, "the server reported no usage")
        return [0] * usage.prompt_tokens

    async def generate(
        self,
        prompt: str | None = None,
        messages=None,
        max_tokens: int = 16,
        ignore_eos: bool = False,
        temperature: float = 0.0,
    ) -> AsyncIterator[Chunk]:
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": temperature,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        if ignore_eos:
            body["ignore_eos"] = True
        if messages is None:
            path, body["prompt"] = "/v1/completions", prompt
        else:
            path, body["messages"] = "/v1/chat/completions", messages
        finish = None
        # The whole request's deadline, as the gRPC client's: httpx's timeout bounds
        # each wait (the first token's included), not a slow stream that keeps coming.
        deadline = time.monotonic() + self.timeout
        try:
            async with self._http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    _raise_for(r)
                async for line in _sse_lines(r):
                    if time.monotonic() > deadline:
                        raise TandemClientError(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"the request took longer than its {self.timeout:g} s timeout",
                        )
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        raise TandemClientError(grpc.StatusCode.UNKNOWN,
                                                event["error"].get("message", ""))  # fmt: skip
                    usage = event.get("usage")
                    for choice in event.get("choices") or ():
                        text = choice.get("text")
                        if text is None:
                            text = (choice.get("delta") or {}).get("content")
                        finish = choice.get("finish_reason") or finish
                        if text:
                            yield Chunk((0,), text=text)
                    if usage:
                        yield Chunk((), Usage(usage["prompt_tokens"],
                                              usage["completion_tokens"]), finish)  # fmt: skip
        except httpx.TimeoutException as exc:
            raise TandemClientError(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)) from None
        except httpx.HTTPError as exc:
            raise TandemClientError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None


async def _sse_lines(r: httpx.Response) -> AsyncIterator[str]:
    """The stream's lines, split at LF (a CR before it dropped), as SSE splits them (but
    at a lone CR, which no server sends). httpx's ``aiter_lines`` also splits at U+2028,
    U+2029 and U+0085 (``str.splitlines``), which may stand unescaped inside an event's
    JSON (valid SSE and JSON): an answer with one of them was counted as a failure."""
    rest = ""
    async for text in r.aiter_text():
        *lines, rest = (rest + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if rest:
        yield rest.removesuffix("\r")


def _raise_for(r: httpx.Response) -> None:
    if r.status_code == 200:
        return
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:200]
    code = _CODES.get(r.status_code, grpc.StatusCode.UNKNOWN)
    raise TandemClientError(code, f"HTTP {r.status_code}: {message}")
