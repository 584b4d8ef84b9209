from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolingKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_KIND_UNSPECIFIED: _ClassVar[PoolingKind]
    POOLING_KIND_EMBED: _ClassVar[PoolingKind]
    POOLING_KIND_SCORE: _ClassVar[PoolingKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_NOT_FOUND: _ClassVar[ErrorCode]
POOLING_KIND_UNSPECIFIED: PoolingKind
POOLING_KIND_EMBED: PoolingKind
POOLING_KIND_SCORE: PoolingKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_UNAVAILABLE: ErrorCode
ERROR_CODE_NOT_FOUND: ErrorCode

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "json_schema", "json_object", "regex", "grammar", "choice", "json_free_whitespace", "prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    JSON_FREE_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: Choice
    json_free_whitespace: bool
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[Choice, _Mapping]] = ..., json_free_whitespace: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class Submit(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "client_request_id", "output_token_ids", "trace_context", "lora_name", "shared_prefix_tokens", "images", "pooling")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    priority: int
    client_request_id: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    trace_context: _containers.ScalarMap[str, str]
    lora_name: str
    shared_prefix_tokens: int
    images: _containers.RepeatedCompositeFieldContainer[Image]
    pooling: Pooling
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., client_request_id: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., lora_name: _Optional[str] = ..., shared_prefix_tokens: _Optional[int] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., pooling: _Optional[_Union[Pooling, _Mapping]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("height", "width", "rgb")
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    RGB_FIELD_NUMBER: _ClassVar[int]
    height: int
    width: int
    rgb: bytes
    def __init__(self, height: _Optional[int] = ..., width: _Optional[int] = ..., rgb: _Optional[bytes] = ...) -> None: ...

class Pooling(_message.Message):
    __slots__ = ("kind", "token_ids")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    kind: PoolingKind
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[PoolingKind, str]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Subscribe(_message.Message):
    __slots__ = ("prefix_cache",)
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    prefix_cache: bool
    def __init__(self, prefix_cache: _Optional[bool] = ...) -> None: ...

class RouterMessage(_message.Message):
    __slots__ = ("submit", "abort", "subscribe")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    submit: Submit
    abort: Abort
    subscribe: Subscribe
    def __init__(self, submit: _Optional[_Union[Submit, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., subscribe: _Optional[_Union[Subscribe, _Mapping]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., rank: _Optional[int] = ...) -> None: ...

class RequestUpdate(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "error_code", "error_message", "timings", "prompt_logprobs", "pooled")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    error_code: ErrorCode
    error_message: str
    timings: WorkerTimings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    pooled: bytes
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., error_code: _Optional[_Union[ErrorCode, str]] = ..., error_message: _Optional[str] = ..., timings: _Optional[_Union[WorkerTimings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., pooled: _Optional[bytes] = ...) -> None: ...

class WorkerTimings(_message.Message):
    __slots__ = ("queue_s", "prefill_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ...) -> None: ...

class PrefixCacheEvents(_message.Message):
    __slots__ = ("reset", "stored", "evicted", "lower_stored", "lower_evicted", "resume_points", "state_stored", "state_evicted")
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    LOWER_STORED_FIELD_NUMBER: _ClassVar[int]
    LOWER_EVICTED_FIELD_NUMBER: _ClassVar[int]
    RESUME_POINTS_FIELD_NUMBER: _ClassVar[int]
    STATE_STORED_FIELD_NUMBER: _ClassVar[int]
    STATE_EVICTED_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    evicted: _containers.RepeatedScalarFieldContainer[int]
    lower_stored: _containers.RepeatedScalarFieldContainer[int]
    lower_evicted: _containers.RepeatedScalarFieldContainer[int]
    resume_points: bool
    state_stored: _containers.RepeatedScalarFieldContainer[int]
    state_evicted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reset: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., evicted: _Optional[_Iterable[int]] = ..., lower_stored: _Optional[_Iterable[int]] = ..., lower_evicted: _Optional[_Iterable[int]] = ..., resume_points: _Optional[bool] = ..., state_stored: _Optional[_Iterable[int]] = ..., state_evicted: _Optional[_Iterable[int]] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("updates", "draining", "load", "prefix_cache", "adapters")
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[RequestUpdate]
    draining: bool
    load: WorkerLoad
    prefix_cache: PrefixCacheEvents
    adapters: LoRAAdapters
    def __init__(self, updates: _Optional[_Iterable[_Union[RequestUpdate, _Mapping]]] = ..., draining: _Optional[bool] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., prefix_cache: _Optional[_Union[PrefixCacheEvents, _Mapping]] = ..., adapters: _Optional[_Union[LoRAAdapters, _Mapping]] = ...) -> None: ...

class LoRAAdapter(_message.Message):
    __slots__ = ("name", "rank", "cache_salt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    cache_salt: int
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., cache_salt: _Optional[int] = ...) -> None: ...

class LoRAAdapters(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model", "architectures", "max_model_len", "vocab_size", "eos_token_ids", "kvcache_block_size", "num_kv_blocks", "max_num_seqs", "tokenizer_files", "chat_template", "dtype", "device", "adapters", "shared_prefix_hints", "image_processor_config", "image_token_id", "hidden_size", "has_head")
    class TokenizerFilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURES_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KVCACHE_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FILES_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_HINTS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PROCESSOR_CONFIG_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    HAS_HEAD_FIELD_NUMBER: _ClassVar[int]
    model: str
    architectures: _containers.RepeatedScalarFieldContainer[str]
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kvcache_block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    tokenizer_files: _containers.ScalarMap[str, bytes]
    chat_template: str
    dtype: str
    device: str
    adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    shared_prefix_hints: bool
    image_processor_config: str
    image_token_id: int
    hidden_size: int
    has_head: bool
    def __init__(self, model: _Optional[str] = ..., architectures: _Optional[_Iterable[str]] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., kvcache_block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., tokenizer_files: _Optional[_Mapping[str, bytes]] = ..., chat_template: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., adapters: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ..., shared_prefix_hints: _Optional[bool] = ..., image_processor_config: _Optional[str] = ..., image_token_id: _Optional[int] = ..., hidden_size: _Optional[int] = ..., has_head: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_waiting", "num_running", "kv_blocks_used", "kv_blocks_free", "prefix_cache_hit_rate", "num_preemptions", "num_connections", "kv_host_blocks", "kv_disk_blocks")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_connections: int
    kv_host_blocks: int
    kv_disk_blocks: int
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., num_connections: _Optional[int] = ..., kv_host_blocks: _Optional[int] = ..., kv_disk_blocks: _Optional[int] = ...) -> None: ...
