from common.pb.tandem.internal.v1 import types_pb2 as _types_pb2
from common.pb.tandem.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "max_tokens", "stop_token_ids", "cache_salt", "n", "lora_name", "structured_output", "beam_search", "traceparent", "tracestate", "kv_retention_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    BEAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    KV_RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _types_pb2.Sampling
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    n: int
    lora_name: str
    structured_output: _generate_pb2.StructuredOutput
    beam_search: BeamSearch
    traceparent: str
    tracestate: str
    kv_retention_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_types_pb2.Sampling, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., n: _Optional[int] = ..., lora_name: _Optional[str] = ..., structured_output: _Optional[_Union[_generate_pb2.StructuredOutput, _Mapping]] = ..., beam_search: _Optional[_Union[BeamSearch, _Mapping]] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ..., kv_retention_s: _Optional[float] = ...) -> None: ...

class BeamSearch(_message.Message):
    __slots__ = ("beam_width", "length_penalty", "early_stopping")
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    beam_width: int
    length_penalty: float
    early_stopping: str
    def __init__(self, beam_width: _Optional[int] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("submit", "abort")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    submit: SubmitRequest
    abort: AbortRequest
    def __init__(self, submit: _Optional[_Union[SubmitRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[SubmitResponse]
    def __init__(self, updates: _Optional[_Iterable[_Union[SubmitResponse, _Mapping]]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "usage", "index", "logprobs", "prompt_logprobs", "cached_tokens", "request_id", "error_code", "error_message", "beam_score")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BEAM_SCORE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _generate_pb2.FinishReason
    usage: _generate_pb2.Usage
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    cached_tokens: int
    request_id: str
    error_code: str
    error_message: str
    beam_score: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_generate_pb2.Usage, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., cached_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., beam_score: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "kv_block_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: _types_pb2.ModelDescription
    kv_block_size: int
    def __init__(self, model: _Optional[_Union[_types_pb2.ModelDescription, _Mapping]] = ..., kv_block_size: _Optional[int] = ...) -> None: ...

class GetPoolStatsRequest(_message.Message):
    __slots__ = ("check_integrity",)
    CHECK_INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    check_integrity: bool
    def __init__(self, check_integrity: _Optional[bool] = ...) -> None: ...

class GetPoolStatsResponse(_message.Message):
    __slots__ = ("pools", "num_requests", "integrity_errors", "num_waiting_requests", "num_waiting_tokens", "rejected_requests", "worker_failures", "restarted_requests")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_ERRORS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    RESTARTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    num_requests: int
    integrity_errors: _containers.RepeatedScalarFieldContainer[str]
    num_waiting_requests: int
    num_waiting_tokens: int
    rejected_requests: int
    worker_failures: int
    restarted_requests: int
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., num_requests: _Optional[int] = ..., integrity_errors: _Optional[_Iterable[str]] = ..., num_waiting_requests: _Optional[int] = ..., num_waiting_tokens: _Optional[int] = ..., rejected_requests: _Optional[int] = ..., worker_failures: _Optional[int] = ..., restarted_requests: _Optional[int] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("worker_id", "role", "address", "num_blocks", "num_free_blocks", "num_requests", "num_cached_blocks", "prefix_hit_tokens", "evictions", "preemptions", "kv_blocks_received", "kv_blocks_reused", "steps", "mean_execute_ms", "mean_step_interval_ms", "num_swap_blocks", "num_free_swap_blocks", "swap_outs", "healthy", "draining", "mean_step_overhead_ms", "kv_migrations_out", "prompt_tokens_computed", "kv_transfers", "kv_source_lag_ms_total", "spec_decode_num_steps", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "num_offload_cpu_blocks", "num_offload_cpu_cached_blocks", "offload_saved_blocks", "offload_loaded_blocks", "offload_hit_tokens", "num_offload_disk_blocks", "offload_disk_saved_blocks", "offload_disk_loaded_blocks", "offload_disk_failed_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_REUSED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_EXECUTE_MS_FIELD_NUMBER: _ClassVar[int]
    MEAN_STEP_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUTS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MEAN_STEP_OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    KV_MIGRATIONS_OUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_LAG_MS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOAD_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOAD_CPU_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_SAVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOAD_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_DISK_SAVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_DISK_LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_DISK_FAILED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _types_pb2.WorkerRole
    address: str
    num_blocks: int
    num_free_blocks: int
    num_requests: int
    num_cached_blocks: int
    prefix_hit_tokens: int
    evictions: int
    preemptions: int
    kv_blocks_received: int
    kv_blocks_reused: int
    steps: int
    mean_execute_ms: float
    mean_step_interval_ms: float
    num_swap_blocks: int
    num_free_swap_blocks: int
    swap_outs: int
    healthy: bool
    draining: bool
    mean_step_overhead_ms: float
    kv_migrations_out: int
    prompt_tokens_computed: int
    kv_transfers: int
    kv_source_lag_ms_total: float
    spec_decode_num_steps: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    num_offload_cpu_blocks: int
    num_offload_cpu_cached_blocks: int
    offload_saved_blocks: int
    offload_loaded_blocks: int
    offload_hit_tokens: int
    num_offload_disk_blocks: int
    offload_disk_saved_blocks: int
    offload_disk_loaded_blocks: int
    offload_disk_failed_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_types_pb2.WorkerRole, str]] = ..., address: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., evictions: _Optional[int] = ..., preemptions: _Optional[int] = ..., kv_blocks_received: _Optional[int] = ..., kv_blocks_reused: _Optional[int] = ..., steps: _Optional[int] = ..., mean_execute_ms: _Optional[float] = ..., mean_step_interval_ms: _Optional[float] = ..., num_swap_blocks: _Optional[int] = ..., num_free_swap_blocks: _Optional[int] = ..., swap_outs: _Optional[int] = ..., healthy: _Optional[bool] = ..., draining: _Optional[bool] = ..., mean_step_overhead_ms: _Optional[float] = ..., kv_migrations_out: _Optional[int] = ..., prompt_tokens_computed: _Optional[int] = ..., kv_transfers: _Optional[int] = ..., kv_source_lag_ms_total: _Optional[float] = ..., spec_decode_num_steps: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., num_offload_cpu_blocks: _Optional[int] = ..., num_offload_cpu_cached_blocks: _Optional[int] = ..., offload_saved_blocks: _Optional[int] = ..., offload_loaded_blocks: _Optional[int] = ..., offload_hit_tokens: _Optional[int] = ..., num_offload_disk_blocks: _Optional[int] = ..., offload_disk_saved_blocks: _Optional[int] = ..., offload_disk_loaded_blocks: _Optional[int] = ..., offload_disk_failed_blocks: _Optional[int] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: _generate_pb2.LoraAdapterInfo
    def __init__(self, adapter: _Optional[_Union[_generate_pb2.LoraAdapterInfo, _Mapping]] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoraAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[_generate_pb2.LoraAdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[_generate_pb2.LoraAdapterInfo, _Mapping]]] = ...) -> None: ...

class KvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEventsResponse(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: KvEventBatch
    def __init__(self, batch: _Optional[_Union[KvEventBatch, _Mapping]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("seq", "ts", "worker_id", "role", "events", "snapshot", "snapshot_done")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DONE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ts: float
    worker_id: str
    role: _types_pb2.WorkerRole
    events: _containers.RepeatedCompositeFieldContainer[KvCacheEvent]
    snapshot: bool
    snapshot_done: bool
    def __init__(self, seq: _Optional[int] = ..., ts: _Optional[float] = ..., worker_id: _Optional[str] = ..., role: _Optional[_Union[_types_pb2.WorkerRole, str]] = ..., events: _Optional[_Iterable[_Union[KvCacheEvent, _Mapping]]] = ..., snapshot: _Optional[bool] = ..., snapshot_done: _Optional[bool] = ...) -> None: ...

class KvCacheEvent(_message.Message):
    __slots__ = ("block_stored", "block_removed", "all_blocks_cleared")
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name", "medium", "cache_salt", "rope_key")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ROPE_KEY_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_name: str
    medium: str
    cache_salt: str
    rope_key: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_name: _Optional[str] = ..., medium: _Optional[str] = ..., cache_salt: _Optional[str] = ..., rope_key: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ("medium",)
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    medium: str
    def __init__(self, medium: _Optional[str] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("num_blocks_dropped",)
    NUM_BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_dropped: int
    def __init__(self, num_blocks_dropped: _Optional[int] = ...) -> None: ...
