"""The router's model-facing half: limits, validation and tokenization.

It loads the model's tokenizer and ``config.json`` only, never weights. A
``GenerateRequest`` becomes a ``PreparedRequest`` (request id, prompt token ids,
sampling) or an ``InvalidRequestError`` naming the field and the limit, in this
order: sampling fields, the input (prompt or chat, roles), then the tokenized
prompt against the context length. All of it happens before any worker is
contacted, so a bad request never allocates a KV block anywhere.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from tandem import wire
from tandem._proto.tandem.v1 import tandem_pb2
from tandem.config import RouterConfig
from tandem.engine.engine import check_request
from tandem.engine.loader import read_config, resolve_model
from tandem.engine.model_config import ModelConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from tandem.errors import ConfigError, InvalidRequestError

# Workers take ids of up to 256 characters; a migrated attempt appends "/<n>".
MAX_REQUEST_ID_CHARS = 200


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class Frontend:
    def __init__(
        self, model_id: str, tokenizer: Tokenizer, context_length: int, vocab_size: int
    ) -> None:
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.vocab_size = vocab_size

    @classmethod
    def load(cls, config: RouterConfig) -> Frontend:
        """Resolves ``config.model`` as the workers do and reads its tokenizer and limits."""
        model_dir = resolve_model(config.model, config.cache_dir)
        model = ModelConfig.from_hf(read_config(model_dir))
        context = model.max_position_embeddings
        if config.max_model_len is not None:
            context = min(config.max_model_len, context)  # as the engine does
        return cls(config.model, Tokenizer.from_pretrained(model_dir), context, model.vocab_size)

    def prepare(self, request: tandem_pb2.GenerateRequest) -> PreparedRequest:
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(
                "request_id",
                f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, "
                f"got {len(request.request_id)}",
            )
        params = wire.sampling_from_proto(request.sampling)
        prompt_ids = self.encode(request)
        check_request(prompt_ids, params, self.context_length, self.vocab_size)
        return PreparedRequest(request.request_id or uuid.uuid4().hex, prompt_ids, params)

    def encode(self, request: tandem_pb2.GenerateRequest | tandem_pb2.TokenizeRequest) -> list[int]:
        """The prompt's token ids: raw text as is, chat through the chat template."""
        kind = request.WhichOneof("input")
        if kind == "prompt":
            if not request.prompt:
                raise InvalidRequestError("prompt", "prompt must not be empty")
            return self.tokenizer.encode(request.prompt)
        if kind == "chat":
            messages = wire.chat_from_proto(request.chat)
            try:
                return self.tokenizer.encode_chat(messages)
            except ConfigError as exc:  # the model has no chat template
                raise InvalidRequestError("chat", str(exc)) from exc
        raise InvalidRequestError("input", "one of prompt or chat must be set")
