"""OpenAI's request and response shapes, mapped onto ``tandem.v1``.

A chat or completions body becomes a ``GenerateRequest`` (the router's one
request path then checks its values as it does for gRPC); responses are built
from ``GenerateResponse``s in OpenAI's exact shapes. What is checked here is
only what ``tandem.v1`` cannot express: JSON types, ``model``, ``n``, the
choice between ``max_tokens`` and ``max_completion_tokens``, the content-part
form of chat messages. Parameters that would change the output and are not
served (``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``best_of``,
``echo``, ``suffix``, ``response_format``, ``tools``) are refused unless neutral;
other unknown fields are ignored, as OpenAI does; ``user`` is accepted and
ignored. Errors are ``ApiError``: an HTTP status and OpenAI's body
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import codecs
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tandem._proto.tandem.v1 import tandem_pb2
from tandem.engine.sampling_params import to_float32
from tandem.errors import InvalidRequestError
from tandem.router.limits import InputLimits

MAX_LOGPROBS = 20
FLOAT32_MAX = 3.4028234663852886e38  # the sampling fields are float32 in tandem.v1
FINISH = {tandem_pb2.FINISH_REASON_STOP: "stop", tandem_pb2.FINISH_REASON_LENGTH: "length"}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        retry_after_s: float = 1.0,  # a 429's
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type, code,
        )  # fmt: skip
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}  # fmt: skip


def bad(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param)


@dataclass(frozen=True)
class Parsed:
    """A request body, checked and mapped."""

    chat: bool
    request: tandem_pb2.GenerateRequest
    stream: bool
    include_usage: bool
    max_tokens_param: str  # which name the client used, for error messages


_NUMBER = (int, float)
_TYPES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
          list: "an array", dict: "an object"}  # fmt: skip


def _field(body: dict, name: str, kind: type, where: str = "") -> Any:
    """``body[name]`` if present and not null, of JSON type ``kind`` (float: any number)."""
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, _NUMBER) if kind is float else isinstance(value, kind)
    if isinstance(value, bool) and kind is not bool:
        ok = False  # JSON true is not a number
    if not ok:
        raise bad(where + name, f"{where + name} must be {_TYPES[kind]}, got "
                                f"{type(value).__name__} {_short(value)}")  # fmt: skip
    return value


def check_text(body: Any) -> None:
    """Every string in a parsed JSON body (keys too) is valid Unicode: JSON's escapes
    can spell a lone surrogate ("\\ud800"), which no UTF-8 encoder takes, and a browser
    that cuts a string inside an emoji sends one. 400 names where it is."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                stack.append((where, key))
                stack.append((f"{where}.{key}" if where else str(key), item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                what = where or "the request body"
                message = f"{what} is not valid Unicode: a lone surrogate at character {exc.start}"
                raise bad(where or None, message) from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def served_model(model: str, model_id: str) -> None:
    """A 404 in OpenAI's words unless ``model`` is the one served."""
    if model != model_id:
        raise ApiError(404, f"The model `{model}` does not exist (this server serves "
                            f"`{model_id}`)", "model", code="model_not_found")  # fmt: skip


def parse(body: Any, chat: bool, model_id: str, limits: InputLimits | None = None) -> Parsed:
    """``limits``: counts (messages, stop strings) checked before anything is built
    from them; the gateway checks every limit again."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    model = _field(body, "model", str)
    if model is None:
        raise bad("model", "model is required")
    served_model(model, model_id)
    n = _field(body, "n", int)
    if n is not None and n != 1:
        raise bad("n", f"n must be 1 (one choice per request), got {n}")
    for name, is_default in _UNSUPPORTED.items():
        if name in body and not is_default(body[name]):
            raise bad(name, f"{name} is not supported by this server; leave it out")
    request = tandem_pb2.GenerateRequest(request_id=uuid.uuid4().hex)
    if limits is not None:
        counted = [("stop", limits.max_stop_strings, "strings")]
        if chat:  # (completions ignores a messages field)
            counted.append(("messages", limits.max_chat_messages, "messages"))
        for name, limit, unit in counted:
            given = body.get(name)
            if isinstance(given, list) and len(given) > limit:
                raise bad(name, f"{name} must be at most {limit} {unit}, got {len(given)}")
    if chat:
        _messages(body, request)
    else:
        _prompt(body, request)
    param = _sampling(body, request.sampling, chat)
    _logprobs(body, request.sampling, chat)
    stream = bool(_field(body, "stream", bool))
    options = _field(body, "stream_options", dict) or {}
    if options and not stream:  # OpenAI's and vLLM's 400: the options would do nothing
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    include_usage = bool(_field(options, "include_usage", bool, "stream_options."))
    return Parsed(chat, request, stream, include_usage, param)


# OpenAI parameters that would change the output, which this server does not honour:
# refused unless at their neutral value, rather than ignored (a client asking for a
# penalty or JSON mode would get output without it, and no error). Unknown fields are
# still ignored, as OpenAI does.
_UNSUPPORTED = {
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: not v,
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: not v,
    "response_format": lambda v: not v or v == {"type": "text"},
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    # vLLM's extensions that change the output, which its clients send the same way.
    "min_tokens": lambda v: v in (None, 0),
    "stop_token_ids": lambda v: not v,
    "bad_words": lambda v: not v,
    "allowed_token_ids": lambda v: not v,
    "guided_json": lambda v: v is None,  # (vLLM before 0.12; since, structured_outputs)
    "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None,
    "guided_grammar": lambda v: v is None,
    "structured_outputs": lambda v: not v,
    "include_stop_str_in_output": lambda v: v in (None, False),
    "skip_special_tokens": lambda v: v in (None, True),
    "add_generation_prompt": lambda v: v in (None, True),
    "continue_final_message": lambda v: v in (None, False),
    "truncate_prompt_tokens": lambda v: v is None,
    "chat_template_kwargs": lambda v: not v,
}


def _messages(body: dict, request: tandem_pb2.GenerateRequest) -> None:
    messages = _field(body, "messages", list)
    if messages is None:
        raise bad("messages", "messages is required")
    request.chat.SetInParent()  # an empty list stays a chat (the router then says why)
    for i, m in enumerate(messages):
        where = f"messages[{i}]."
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object")
        role = _field(m, "role", str, where)
        if role is None:
            raise bad(where + "role", f"{where}role is required")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad(f"{where}content[{j}]", f"{where}content[{j}] must be a text "
                              "part ({\"type\": \"text\", \"text\": ...}): this model reads "
                              "text only")  # fmt: skip
                texts.append(_field(part, "text", str, f"{where}content[{j}].") or "")
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise bad(where + "content", f"{where}content must be a string or an array of "
                                         "text parts")  # fmt: skip
        request.chat.messages.add(role=role, content=content or "")


def _prompt(body: dict, request: tandem_pb2.GenerateRequest) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise bad("prompt", "prompt must be a string (or an array of exactly one string)")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt", "prompt is required and must be a string")
    request.prompt = prompt


def _sampling(body: dict, s: tandem_pb2.SamplingParams, chat: bool) -> str:
    """Fills ``s``; returns the name the client gave the token limit (either API may
    use either: OpenAI's chat renamed it, and a completions client that sends the new
    name must not get 256 tokens)."""
    param = "max_tokens"
    limit = _field(body, "max_tokens", int)
    if body.get("max_completion_tokens") is not None:
        limit, param = _field(body, "max_completion_tokens", int), "max_completion_tokens"
    if limit is not None:
        s.max_tokens = _int32(param, limit)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        value = _field(body, name, float)
        if value is not None:
            if not abs(value) <= FLOAT32_MAX:  # a float field: past it, inf (a huge int: a 500)
                raise bad(name, f"{name} must be within float32's range, got {_short(value)}")
            try:
                setattr(s, name, to_float32(name, value))  # under float32's range: not 0
            except InvalidRequestError as exc:
                raise bad(name, str(exc)) from None
    top_k = _field(body, "top_k", int)
    if top_k is not None:
        if top_k < -1:
            raise bad("top_k", f"top_k must be -1 or 0 (off) or at least 1, got {top_k}")
        s.top_k = max(0, _int32("top_k", top_k))  # vLLM's -1 means off, as 0 does here
    seed = _field(body, "seed", int)
    if seed is not None:
        if not -(2**63) <= seed < 2**63:
            raise bad("seed", f"seed must fit in 64 bits, got {seed}")
        s.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise bad("stop", "stop must be a string or an array of strings")
        s.stop.extend(stop)
    if _field(body, "ignore_eos", bool):
        s.ignore_eos = True
    return param


def _logprobs(body: dict, s: tandem_pb2.SamplingParams, chat: bool) -> None:
    """Chat: ``logprobs`` (bool) and ``top_logprobs`` (0-20); completions: ``logprobs``
    (the number of alternatives, 0-20; OpenAI's own limit there is 5)."""
    if chat:
        top = _field(body, "top_logprobs", int)
        if not _field(body, "logprobs", bool):
            if top is not None:
                raise bad("top_logprobs", "top_logprobs needs logprobs: true")
            return
        top = 0 if top is None else top
        name = "top_logprobs"
    else:
        top, name = _field(body, "logprobs", int), "logprobs"
        if top is None:
            return
    if not 0 <= top <= MAX_LOGPROBS:
        raise bad(name, f"{name} must be in [0, {MAX_LOGPROBS}], got {top}")
    s.logprobs = top


def _int32(name: str, value: int) -> int:
    if not -(2**31) <= value < 2**31:
        raise bad(name, f"{name} must be a 32-bit integer, got {value}")
    return value


def param_of(field: str, parsed: Parsed | None) -> str:
    """A tandem.v1 field name (an InvalidRequestError's) as the client named it."""
    if field.startswith("chat.messages"):
        return field.removeprefix("chat.")
    if field == "input":
        return "messages" if parsed is None or parsed.chat else "prompt"
    if field == "prompt" and parsed is not None and parsed.chat:  # its tokens: the template's
        return "messages"
    if field == "max_tokens" and parsed is not None:
        return parsed.max_tokens_param
    return field


# ---- responses ---------------------------------------------------------------------------


class Shaper:
    """OpenAI's response objects for one request."""

    def __init__(self, parsed: Parsed, model: str, tokenizer) -> None:
        """``tokenizer``: the router's, which names the tokens in logprobs."""
        self.chat = parsed.chat
        self.model = model
        self.include_usage = parsed.include_usage
        self.tokenizer = tokenizer
        self.offset = 0  # completions' text_offset: characters before the next token
        self._chars = codecs.getincrementaldecoder("utf-8")("replace")  # counts them
        self._sent = 0  # characters of text sent to the client so far
        # Completions' logprobs held back, with their offsets: tokens whose text is held
        # back too (it may be the start of a stop string; see ``_completion_logprobs``).
        self._held: list[tuple[Any, int]] = []
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        self.id = prefix + parsed.request.request_id
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, logprobs, text: str = "", final: bool = True) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` object for these ``tandem.v1.TokenLogprob``s, which came
        with ``text`` (completions: the text sent with them; ``final``: nothing follows)."""
        if self.chat:
            if not logprobs:
                return None
            return {"content": [
                {**self._token(lp), "top_logprobs": [self._token(t) for t in lp.top]}
                for lp in logprobs
            ], "refusal": None}  # fmt: skip
        return self._completion_logprobs(logprobs, text, final)

    def _completion_logprobs(self, logprobs, text: str, final: bool) -> dict[str, Any] | None:
        """``text_offset`` is where each token starts in the text the client gets: the
        characters of the tokens before it, at most the text's length. A stop string
        cuts the text, not the tokens: every token sampled is listed (``usage`` counts
        them), and those that start in the cut-off text are placed at its end. While
        streamed, a token that starts past the text sent so far (its text is held back,
        as the possible start of a stop string) waits with it: for the text that
        places it, or for the end of the stream, where the stop string may cut it."""
        for lp in logprobs:
            self._held.append((lp, self.offset))  # a character's last token moves past it
            self.offset += len(self._chars.decode(self.tokenizer.token_bytes(lp.token_id)))
        self._sent += len(text)
        ready = len(self._held)
        if not final:
            ready = next((i for i, (_, at) in enumerate(self._held) if at > self._sent), ready)
        out, self._held = self._held[:ready], self._held[ready:]
        if not out:
            return None
        return {
            "tokens": [self._name(lp.token_id) for lp, _ in out],
            "token_logprobs": [lp.logprob for lp, _ in out],
            "top_logprobs": [{self._name(t.token_id): t.logprob for t in lp.top} for lp, _ in out],
            "text_offset": [min(at, self._sent) for _, at in out],
        }

    def _name(self, token_id: int) -> str:
        """A token's name: its text, its bytes where it holds part of a character, or
        a special token's text as written (each special token stands for no bytes, and
        the completions API keys alternatives by name)."""
        special = self.tokenizer.special_name(token_id)
        if special is not None:
            return special
        return token_text(self.tokenizer.token_bytes(token_id))

    def _token(self, lp) -> dict[str, Any]:
        raw = self.tokenizer.token_bytes(lp.token_id)
        return {"token": self._name(lp.token_id), "logprob": lp.logprob, "bytes": list(raw)}

    def complete(
        self, text: str, finish: int, usage: tandem_pb2.Usage, logprobs=()
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": self.logprobs(logprobs, text),
                                  "finish_reason": FINISH.get(finish)}  # fmt: skip
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._base(self.object), "choices": [choice], "usage": usage_json(usage)}

    def chunk(
        self, text: str, finish: int = 0, role: bool = False, logprobs=()
    ) -> dict[str, Any] | None:
        """One streamed choice delta (chat: the first has ``role`` and empty content;
        the last has finish_reason, and content only if it brings text); None when
        there is nothing to send (a token whose logprobs wait for its text)."""
        shaped = self.logprobs(logprobs, text, final=bool(finish))
        if not (text or finish or role or shaped):
            return None
        choice: dict[str, Any] = {"index": 0, "logprobs": shaped,
                                  "finish_reason": FINISH.get(finish)}  # fmt: skip
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
            obj = "chat.completion.chunk"
        else:
            choice["text"] = text
            obj = "text_completion"
        chunk = {**self._base(obj), "choices": [choice]}
        if self.include_usage:  # OpenAI's: null on every chunk but the usage chunk
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: tandem_pb2.Usage) -> dict[str, Any]:
        """``stream_options.include_usage``: the last chunk, with no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage_json(usage)}


def token_text(raw: bytes) -> str:
    """A token's text, or for one that holds part of a UTF-8 character its bytes as
    ``bytes:\\xNN...`` (vLLM's spelling): distinct tokens keep distinct names."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def usage_json(usage: tandem_pb2.Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}  # fmt: skip
