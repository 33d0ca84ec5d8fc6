from tandem._proto.tandem.v1 import tandem_pb2 as _tandem_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role

class RenewLeaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("renewed",)
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    renewed: bool
    def __init__(self, renewed: _Optional[bool] = ...) -> None: ...

class WorkerRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "output_token_ids", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _tandem_pb2.SamplingParams
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_tandem_pb2.SamplingParams, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class KvDestination(_message.Message):
    __slots__ = ("address", "request_id", "block_ids", "lease_seconds", "skip_blocks", "block_size")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    address: str
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_seconds: float
    skip_blocks: int
    block_size: int
    def __init__(self, address: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., lease_seconds: _Optional[float] = ..., skip_blocks: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "destination")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    request: WorkerRequest
    destination: KvDestination
    def __init__(self, request: _Optional[_Union[WorkerRequest, _Mapping]] = ..., destination: _Optional[_Union[KvDestination, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "text", "finish_reason", "kv_bytes", "kv_transfer_seconds", "first_logprob")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    text: str
    finish_reason: _tandem_pb2.FinishReason
    kv_bytes: int
    kv_transfer_seconds: float
    first_logprob: _tandem_pb2.TokenLogprob
    def __init__(self, first_token_id: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_tandem_pb2.FinishReason, str]] = ..., kv_bytes: _Optional[int] = ..., kv_transfer_seconds: _Optional[float] = ..., first_logprob: _Optional[_Union[_tandem_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request", "prefill_here", "prompt_whole")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HERE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_WHOLE_FIELD_NUMBER: _ClassVar[int]
    request: WorkerRequest
    prefill_here: bool
    prompt_whole: bool
    def __init__(self, request: _Optional[_Union[WorkerRequest, _Mapping]] = ..., prefill_here: _Optional[bool] = ..., prompt_whole: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("destination", "chunk")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    destination: KvDestination
    chunk: TokenChunk
    def __init__(self, destination: _Optional[_Union[KvDestination, _Mapping]] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "completion_tokens", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _tandem_pb2.FinishReason
    completion_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_tandem_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_tandem_pb2.FinishReason, str]] = ..., completion_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_tandem_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "queue_depth", "running", "kv_blocks_used", "kv_blocks_free", "kv_blocks_total", "kv_address", "served", "kv_transfers_total", "kv_bytes_total", "kv_transfer_seconds_total", "prefix_query_tokens", "prefix_hit_tokens", "prefilled_here", "metrics_address", "host_blocks_used", "host_swaps_out_total", "host_swaps_in_total", "host_prefix_hit_blocks_total", "tensor_parallel_size", "decode_step_seconds", "prefill_token_seconds", "shipped_prefix_query_tokens", "shipped_prefix_hit_tokens", "kv_block_size", "kv_window_tokens", "prefix_cache_max_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_HERE_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_SWAPS_OUT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_SWAPS_IN_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_PREFIX_HIT_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHIPPED_PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHIPPED_PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: Role
    queue_depth: int
    running: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_address: str
    served: int
    kv_transfers_total: int
    kv_bytes_total: int
    kv_transfer_seconds_total: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefilled_here: int
    metrics_address: str
    host_blocks_used: int
    host_swaps_out_total: int
    host_swaps_in_total: int
    host_prefix_hit_blocks_total: int
    tensor_parallel_size: int
    decode_step_seconds: float
    prefill_token_seconds: float
    shipped_prefix_query_tokens: int
    shipped_prefix_hit_tokens: int
    kv_block_size: int
    kv_window_tokens: int
    prefix_cache_max_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., queue_depth: _Optional[int] = ..., running: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_address: _Optional[str] = ..., served: _Optional[int] = ..., kv_transfers_total: _Optional[int] = ..., kv_bytes_total: _Optional[int] = ..., kv_transfer_seconds_total: _Optional[float] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefilled_here: _Optional[int] = ..., metrics_address: _Optional[str] = ..., host_blocks_used: _Optional[int] = ..., host_swaps_out_total: _Optional[int] = ..., host_swaps_in_total: _Optional[int] = ..., host_prefix_hit_blocks_total: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., decode_step_seconds: _Optional[float] = ..., prefill_token_seconds: _Optional[float] = ..., shipped_prefix_query_tokens: _Optional[int] = ..., shipped_prefix_hit_tokens: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_window_tokens: _Optional[int] = ..., prefix_cache_max_tokens: _Optional[int] = ...) -> None: ...
