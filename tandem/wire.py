"""Conversions between protobuf messages and internal types (protobuf stops here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem._proto.tandem.v1 import tandem_pb2, worker_pb2
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import FinishReason
from tandem.errors import InvalidRequestError

if TYPE_CHECKING:  # the sampler imports torch; the wire types must not
    from tandem.engine.sampler import TokenLogprob

DEFAULT_MAX_TOKENS = 256

_FINISH_TO_PROTO = {
    None: tandem_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: tandem_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: tandem_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: tandem_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: tandem_pb2.FINISH_REASON_ERROR,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def sampling_from_proto(p: tandem_pb2.SamplingParams) -> SamplingParams:
    """Unset fields take their documented defaults; out-of-range values raise
    InvalidRequestError naming the field."""
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k if p.HasField("top_k") else 0,
        min_p=p.min_p if p.HasField("min_p") else 0.0,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
    )


def sampling_to_proto(s: SamplingParams) -> tandem_pb2.SamplingParams:
    """Every field set, so the receiving side needs no defaults of its own."""
    p = tandem_pb2.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        stop=list(s.stop),
        ignore_eos=s.ignore_eos,
    )
    if s.seed is not None:
        p.seed = s.seed
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    return p


def logprob_to_proto(lp: TokenLogprob) -> tandem_pb2.TokenLogprob:
    return tandem_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[tandem_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def chat_from_proto(chat: tandem_pb2.Chat) -> list[dict[str, str]]:
    if not chat.messages:
        raise InvalidRequestError("chat.messages", "chat.messages must not be empty")
    roles = ("system", "user", "assistant")
    out = []
    for i, m in enumerate(chat.messages):
        if m.role not in roles:
            raise InvalidRequestError(
                f"chat.messages[{i}].role",
                f"chat.messages[{i}].role must be one of {', '.join(roles)}, got {m.role!r}",
            )
        out.append({"role": m.role, "content": m.content})
    return out


def finish_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_TO_PROTO[reason]


def finish_from_proto(value: int) -> FinishReason | None:
    return _FINISH_FROM_PROTO.get(value)


def worker_request(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    output_ids: list[int] | None = None,
    cache_salt: str = "",
) -> worker_pb2.WorkerRequest:
    """``output_ids``: tokens already streamed to the client, for a worker to continue
    after; ``cache_salt``: the prefix cache's namespace (``LLMEngine.add_request``)."""
    return worker_pb2.WorkerRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling_to_proto(params),
        output_token_ids=output_ids or [],
        cache_salt=cache_salt,
    )
