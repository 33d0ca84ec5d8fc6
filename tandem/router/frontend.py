"""The router's model-facing half: limits, validation and tokenization.

It loads the model's tokenizer and ``config.json`` only, never weights. A
``GenerateRequest`` becomes a ``PreparedRequest`` (request id, prompt token ids,
sampling) or an ``InvalidRequestError`` naming the field and the limit, in two
steps:

- ``check`` (on the event loop, lengths and counts only): request id, stop
  strings, sampling fields, then the input (prompt or chat: limits, roles);
- ``prepare`` (awaited after admission): tokenizes in a small thread pool, off
  the event loop, then checks the token count against the context length.

So a huge request is refused before any tokenizer sees it, one that is merely
big never stalls other streams while it tokenizes, and all of it happens before
any worker is contacted: a bad request never allocates a KV block anywhere.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import jinja2

from tandem import wire
from tandem._proto.tandem.v1 import tandem_pb2
from tandem.config import RouterConfig
from tandem.engine.checks import check_request
from tandem.engine.loader import (
    gguf_file,
    needs_building,
    read_config,
    read_model_config,
    resolve_model,
)
from tandem.engine.model_config import ModelConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from tandem.errors import ConfigError, InvalidRequestError
from tandem.router.limits import InputLimits

# Threads that tokenize (HF tokenizers encode without the GIL and is thread-safe).
# Two keep one long prompt from delaying every other request's first token, and
# admission bounds what waits for them.
TOKENIZER_THREADS = 2

TextInput = str | list[dict[str, str]]  # a raw prompt, or chat messages for the template


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed every check that needs no tokenizer."""

    request_id: str
    text: TextInput
    params: SamplingParams
    # False where the client left max_tokens unset: its default then stops at the
    # context's end rather than refusing a prompt that leaves it less room.
    max_tokens_given: bool = True


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str  # the client's
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str = ""  # the API key's tag ("": keys are off), see ``worker_id``

    @property
    def worker_id(self) -> str:
        """The request's id in the router's and the workers' books: the client's id
        within its key's namespace, so that one key's caller can neither block nor
        learn of another key's ids ("~" is outside the ids a client may choose)."""
        return f"{self.tenant}~{self.request_id}" if self.tenant else self.request_id


class Frontend:
    def __init__(
        self,
        model_id: str,
        tokenizer: Tokenizer,
        context_length: int,
        vocab_size: int,
        limits: InputLimits | None = None,
    ) -> None:
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.limits = limits or InputLimits.from_config(RouterConfig(), context_length)
        self._executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    @classmethod
    def load(cls, config: RouterConfig) -> Frontend:
        """Reads ``config.model``'s tokenizer and limits as the workers see the model. A
        GGUF whose dequantised copy is not in this machine's cache is read as it is:
        the router needs no weights (a router on a head node dequantised the whole
        model for its tokenizer: minutes and the model's float32 size for a 7B)."""
        gguf = gguf_file(config.model)
        if gguf is not None and needs_building(config.model, config.cache_dir):
            model = ModelConfig.from_hf(read_model_config(config.model))
            tokenizer = Tokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        else:
            model_dir = resolve_model(config.model, config.cache_dir)
            model = ModelConfig.from_hf(read_config(model_dir), str(model_dir / "config.json"))
            tokenizer = Tokenizer.from_pretrained(model_dir)
        context = model.max_position_embeddings
        if config.max_model_len is not None:
            context = min(config.max_model_len, context)  # as the engine does
        limits = InputLimits.from_config(config, context)
        return cls(config.model, tokenizer, context, model.vocab_size, limits)

    def with_limits(self, config: RouterConfig) -> Frontend:
        """The same tokenizer and threads under ``config``'s input limits."""
        other = copy.copy(self)
        other.limits = InputLimits.from_config(config, self.context_length)
        return other

    def check(self, request: tandem_pb2.GenerateRequest) -> CheckedRequest:
        self.limits.check_request_id(request.request_id)
        self.limits.check_stop(request.sampling.stop)
        params = wire.sampling_from_proto(request.sampling)
        text = self.check_input(request)
        given = request.sampling.HasField("max_tokens")
        return CheckedRequest(request.request_id or uuid.uuid4().hex, text, params, given)

    def check_input(
        self, request: tandem_pb2.GenerateRequest | tandem_pb2.TokenizeRequest
    ) -> TextInput:
        """The prompt or chat messages, within the limits; nothing tokenized yet."""
        kind = request.WhichOneof("input")
        if kind == "prompt":
            if not request.prompt:
                raise InvalidRequestError("prompt", "prompt must not be empty")
            self.limits.check_prompt(request.prompt)
            return request.prompt
        if kind == "chat":
            self.limits.check_chat(request.chat)
            return wire.chat_from_proto(request.chat)
        raise InvalidRequestError("input", "one of prompt or chat must be set")

    async def prepare(
        self, checked: CheckedRequest, tenant: str = "", capacity: int | None = None
    ) -> PreparedRequest:
        """``capacity``: the most tokens a decode worker's KV pool holds for one
        sequence, where that is less than the context (None: unknown, the workers
        check)."""
        prompt_ids = await self.encode(checked.text)
        params = checked.params
        if capacity is None or capacity >= self.context_length:
            limit, what = self.context_length, f"the context length {self.context_length}"
        else:
            limit = capacity
            what = f"what a decode worker's KV pool holds for one sequence ({capacity} tokens)"
        room = limit - len(prompt_ids)
        if not checked.max_tokens_given and room < params.max_tokens:
            if room < 1:  # the limit is the server's default: the prompt is what is wrong
                raise InvalidRequestError(
                    "prompt", f"prompt ({len(prompt_ids)} tokens) leaves no room to generate "
                    f"in {what}",
                )  # fmt: skip
            params = replace(params, max_tokens=room)  # as OpenAI and vLLM do
        check_request(prompt_ids, params, self.context_length, self.vocab_size)
        if len(prompt_ids) + params.max_tokens > limit:  # the pool, the smaller limit
            raise InvalidRequestError(
                "max_tokens", f"prompt ({len(prompt_ids)} tokens) + max_tokens "
                f"({params.max_tokens}) = {len(prompt_ids) + params.max_tokens} exceeds {what}",
            )  # fmt: skip
        return PreparedRequest(checked.request_id, prompt_ids, params, tenant)

    async def encode(self, text: TextInput) -> list[int]:
        """The prompt's token ids (raw text as is, chat through the chat template),
        computed in the tokenizer threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._encode, text)

    def _encode(self, text: TextInput) -> list[int]:
        if isinstance(text, str):
            return self.tokenizer.encode(text)
        try:
            return self.tokenizer.encode_chat(text)
        except ConfigError as exc:  # the model has no chat template
            raise InvalidRequestError("chat", str(exc)) from exc
        except jinja2.TemplateError as exc:  # it refuses them (Llama 2's, Mistral's: roles)
            raise InvalidRequestError(
                "chat.messages", f"the model's chat template refuses these messages: {exc}"
            ) from exc

    def close(self) -> None:
        """Stops the tokenizer threads (after the job in hand); shared by ``with_limits`` copies."""
        self._executor.shutdown(wait=False, cancel_futures=True)
