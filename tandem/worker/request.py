"""A worker request off the wire: parsed and checked before any KV block is taken."""

from __future__ import annotations

from dataclasses import dataclass

from tandem._proto.tandem.v1 import worker_pb2
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.errors import InvalidRequestError
from tandem.wire import sampling_from_proto

MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256


@dataclass(frozen=True)
class WorkRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # Tokens already generated and streamed (a request moved off a failed worker):
    # the engine continues after them; they count towards params.max_tokens.
    output_ids: list[int]
    cache_salt: str = ""  # the prefix cache's namespace (LLMEngine.add_request)


def parse_request(
    p: worker_pb2.WorkerRequest, engine: LLMEngine, prefill_only: bool = False
) -> WorkRequest:
    """Raise InvalidRequestError (field and limit named) unless ``engine`` can run it.

    Reads only the engine's fixed limits, so it is safe off the engine thread.
    """
    rid = p.request_id
    if not rid:
        raise InvalidRequestError("request_id", "request_id must not be empty")
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            "request_id",
            f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(rid)}",
        )
    if len(p.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(
            "cache_salt",
            f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, "
            f"got {len(p.cache_salt)}",
        )
    params = sampling_from_proto(p.sampling)
    prompt = list(p.prompt_token_ids)
    output = list(p.output_token_ids)
    engine.validate(prompt, params, output, prefill_only)
    return WorkRequest(rid, prompt, params, output, p.cache_salt)
