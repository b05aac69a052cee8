from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "num_logprobs", "min_tokens", "stop_token_ids", "constraint_kind", "constraint_spec", "logit_bias", "allowed_token_ids", "prompt_logprobs", "bad_words_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_KIND_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_SPEC_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    num_logprobs: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    constraint_kind: str
    constraint_spec: str
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., num_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., constraint_kind: _Optional[str] = ..., constraint_spec: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("handle", "request_id", "token_ids", "num_prompt_tokens", "sampling", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "skip_sampling", "pooling", "lora_id", "lora_path")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    handle: int
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    skip_sampling: bool
    pooling: str
    lora_id: int
    lora_path: str
    def __init__(self, handle: _Optional[int] = ..., request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., skip_sampling: _Optional[bool] = ..., pooling: _Optional[str] = ..., lora_id: _Optional[int] = ..., lora_path: _Optional[str] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("handle", "new_token_ids", "new_block_ids", "num_scheduled_tokens", "resumed", "num_computed_tokens", "skip_sampling", "num_prompt_tokens", "num_lookahead_tokens")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: int
    resumed: bool
    num_computed_tokens: int
    skip_sampling: bool
    num_prompt_tokens: int
    num_lookahead_tokens: int
    def __init__(self, handle: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[int] = ..., resumed: _Optional[bool] = ..., num_computed_tokens: _Optional[int] = ..., skip_sampling: _Optional[bool] = ..., num_prompt_tokens: _Optional[int] = ..., num_lookahead_tokens: _Optional[int] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_requests", "finished", "preempted", "trace_context", "decode_handles", "offload_blocks", "offload_slots", "load_slots", "load_blocks", "offload_now", "lora_prefetch")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DECODE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_NOW_FIELD_NUMBER: _ClassVar[int]
    LORA_PREFETCH_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    finished: _containers.RepeatedScalarFieldContainer[int]
    preempted: _containers.RepeatedScalarFieldContainer[int]
    trace_context: _containers.ScalarMap[str, str]
    decode_handles: _containers.RepeatedScalarFieldContainer[int]
    offload_blocks: _containers.RepeatedScalarFieldContainer[int]
    offload_slots: _containers.RepeatedScalarFieldContainer[int]
    load_slots: _containers.RepeatedScalarFieldContainer[int]
    load_blocks: _containers.RepeatedScalarFieldContainer[int]
    offload_now: _containers.RepeatedScalarFieldContainer[bool]
    lora_prefetch: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., finished: _Optional[_Iterable[int]] = ..., preempted: _Optional[_Iterable[int]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., decode_handles: _Optional[_Iterable[int]] = ..., offload_blocks: _Optional[_Iterable[int]] = ..., offload_slots: _Optional[_Iterable[int]] = ..., load_slots: _Optional[_Iterable[int]] = ..., load_blocks: _Optional[_Iterable[int]] = ..., offload_now: _Optional[_Iterable[bool]] = ..., lora_prefetch: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ...) -> None: ...

class LoRAAdapter(_message.Message):
    __slots__ = ("lora_id", "lora_path")
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_id: int
    lora_path: str
    def __init__(self, lora_id: _Optional[int] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoRAFailure(_message.Message):
    __slots__ = ("lora_id", "message")
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    lora_id: int
    message: str
    def __init__(self, lora_id: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("handle", "start", "logprobs", "ranks", "top_logprobs")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    start: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, handle: _Optional[int] = ..., start: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "handles", "token_ids", "logprobs", "top_logprobs", "compute_seconds", "forward_seconds", "constraint_done", "constraint_seconds", "error", "moe_collective_bytes", "spec_handles", "spec_counts", "spec_num_drafts", "spec_token_ids", "spec_logprobs", "spec_top_logprobs", "kv_transfer_seconds", "kv_transfer_bytes", "prompt_logprobs", "pooled", "lora_loads", "lora_evictions", "lora_load_seconds", "lora_ready", "lora_dropped", "lora_failed")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_DONE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MOE_COLLECTIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPEC_HANDLES_FIELD_NUMBER: _ClassVar[int]
    SPEC_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    LORA_LOADS_FIELD_NUMBER: _ClassVar[int]
    LORA_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LORA_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LORA_READY_FIELD_NUMBER: _ClassVar[int]
    LORA_DROPPED_FIELD_NUMBER: _ClassVar[int]
    LORA_FAILED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    handles: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    compute_seconds: float
    forward_seconds: float
    constraint_done: _containers.RepeatedScalarFieldContainer[int]
    constraint_seconds: float
    error: str
    moe_collective_bytes: int
    spec_handles: _containers.RepeatedScalarFieldContainer[int]
    spec_counts: _containers.RepeatedScalarFieldContainer[int]
    spec_num_drafts: _containers.RepeatedScalarFieldContainer[int]
    spec_token_ids: _containers.RepeatedScalarFieldContainer[int]
    spec_logprobs: _containers.RepeatedScalarFieldContainer[float]
    spec_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    kv_transfer_seconds: float
    kv_transfer_bytes: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    pooled: _containers.RepeatedCompositeFieldContainer[PooledOutput]
    lora_loads: int
    lora_evictions: int
    lora_load_seconds: float
    lora_ready: _containers.RepeatedScalarFieldContainer[int]
    lora_dropped: _containers.RepeatedScalarFieldContainer[int]
    lora_failed: _containers.RepeatedCompositeFieldContainer[LoRAFailure]
    def __init__(self, step_id: _Optional[int] = ..., handles: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., compute_seconds: _Optional[float] = ..., forward_seconds: _Optional[float] = ..., constraint_done: _Optional[_Iterable[int]] = ..., constraint_seconds: _Optional[float] = ..., error: _Optional[str] = ..., moe_collective_bytes: _Optional[int] = ..., spec_handles: _Optional[_Iterable[int]] = ..., spec_counts: _Optional[_Iterable[int]] = ..., spec_num_drafts: _Optional[_Iterable[int]] = ..., spec_token_ids: _Optional[_Iterable[int]] = ..., spec_logprobs: _Optional[_Iterable[float]] = ..., spec_top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., kv_transfer_seconds: _Optional[float] = ..., kv_transfer_bytes: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., pooled: _Optional[_Iterable[_Union[PooledOutput, _Mapping]]] = ..., lora_loads: _Optional[int] = ..., lora_evictions: _Optional[int] = ..., lora_load_seconds: _Optional[float] = ..., lora_ready: _Optional[_Iterable[int]] = ..., lora_dropped: _Optional[_Iterable[int]] = ..., lora_failed: _Optional[_Iterable[_Union[LoRAFailure, _Mapping]]] = ...) -> None: ...

class PooledOutput(_message.Message):
    __slots__ = ("handle", "values")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    handle: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, handle: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...
