from splitserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("model", "num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "kv_cache_dtype", "kv_scales", "tensor_parallel_size", "page_order")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_ORDER_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    kv_cache_dtype: str
    kv_scales: str
    tensor_parallel_size: int
    page_order: str
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., kv_scales: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., page_order: _Optional[str] = ...) -> None: ...

class TransportOffer(_message.Message):
    __slots__ = ("transport", "address")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    transport: str
    address: str
    def __init__(self, transport: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class TransferDescriptor(_message.Message):
    __slots__ = ("request_id", "transport", "address", "block_ids", "layout", "epoch", "lease_deadline", "alternatives", "num_cached_blocks", "rank_offers")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transport: str
    address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    layout: KVLayout
    epoch: int
    lease_deadline: float
    alternatives: _containers.RepeatedCompositeFieldContainer[TransportOffer]
    num_cached_blocks: int
    rank_offers: _containers.RepeatedCompositeFieldContainer[RankOffers]
    def __init__(self, request_id: _Optional[str] = ..., transport: _Optional[str] = ..., address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., epoch: _Optional[int] = ..., lease_deadline: _Optional[float] = ..., alternatives: _Optional[_Iterable[_Union[TransportOffer, _Mapping]]] = ..., num_cached_blocks: _Optional[int] = ..., rank_offers: _Optional[_Iterable[_Union[RankOffers, _Mapping]]] = ...) -> None: ...

class RankOffers(_message.Message):
    __slots__ = ("offers",)
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    offers: _containers.RepeatedCompositeFieldContainer[TransportOffer]
    def __init__(self, offers: _Optional[_Iterable[_Union[TransportOffer, _Mapping]]] = ...) -> None: ...

class ResolvedSampling(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "ignore_eos", "stop_token_ids", "logprobs", "structured_output", "structured_output_resumed_tokens", "structured_output_after_token_ids", "structured_output_after_opener", "lora")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_AFTER_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_AFTER_OPENER_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    structured_output: _generation_pb2.StructuredOutput
    structured_output_resumed_tokens: int
    structured_output_after_token_ids: _containers.RepeatedScalarFieldContainer[int]
    structured_output_after_opener: int
    lora: str
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[_generation_pb2.StructuredOutput, _Mapping]] = ..., structured_output_resumed_tokens: _Optional[int] = ..., structured_output_after_token_ids: _Optional[_Iterable[int]] = ..., structured_output_after_opener: _Optional[int] = ..., lora: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "prompt_token_ids", "structured_output")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    structured_output: _generation_pb2.StructuredOutput
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., structured_output: _Optional[_Union[_generation_pb2.StructuredOutput, _Mapping]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("descriptor", "lease_ttl_s")
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    descriptor: TransferDescriptor
    lease_ttl_s: float
    def __init__(self, descriptor: _Optional[_Union[TransferDescriptor, _Mapping]] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("request_id", "epoch")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease_ttl_s",)
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_s: float
    def __init__(self, lease_ttl_s: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "descriptor", "arrival_time")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: ResolvedSampling
    priority: int
    descriptor: TransferDescriptor
    arrival_time: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[ResolvedSampling, _Mapping]] = ..., priority: _Optional[int] = ..., descriptor: _Optional[_Union[TransferDescriptor, _Mapping]] = ..., arrival_time: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "epoch", "first_token", "first_logprobs", "checksum", "transport", "num_copies", "prefill_ms", "kv_transfer_ms", "cached_prompt_tokens", "sampler_state")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NUM_COPIES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_STATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    first_token: int
    first_logprobs: _generation_pb2.TokenLogprobs
    checksum: int
    transport: str
    num_copies: int
    prefill_ms: float
    kv_transfer_ms: float
    cached_prompt_tokens: int
    sampler_state: bytes
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ..., first_token: _Optional[int] = ..., first_logprobs: _Optional[_Union[_generation_pb2.TokenLogprobs, _Mapping]] = ..., checksum: _Optional[int] = ..., transport: _Optional[str] = ..., num_copies: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., kv_transfer_ms: _Optional[float] = ..., cached_prompt_tokens: _Optional[int] = ..., sampler_state: _Optional[bytes] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "epoch", "prompt_token_ids", "sampling", "priority", "first_token", "first_logprobs", "checksum", "arrival_time", "sampler_state")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_STATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: ResolvedSampling
    priority: int
    first_token: int
    first_logprobs: _generation_pb2.TokenLogprobs
    checksum: int
    arrival_time: float
    sampler_state: bytes
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[ResolvedSampling, _Mapping]] = ..., priority: _Optional[int] = ..., first_token: _Optional[int] = ..., first_logprobs: _Optional[_Union[_generation_pb2.TokenLogprobs, _Mapping]] = ..., checksum: _Optional[int] = ..., arrival_time: _Optional[float] = ..., sampler_state: _Optional[bytes] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "cached_prompt_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    finish_reason: str
    cached_prompt_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class WorkerAbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class WorkerAbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
