from common.pb.tandem.internal.v1 import types_pb2 as _types_pb2
from common.pb.tandem.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeWorkerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "role", "model", "kv_cache", "ucx_address", "num_active_requests", "device", "kv_shared_memory", "speculative", "tensor_parallel_size", "rank_kv_shared_memory", "pipeline_parallel_size", "rank_ucx_addresses", "max_loras", "boot_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_KV_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_UCX_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _types_pb2.WorkerRole
    model: _types_pb2.ModelDescription
    kv_cache: _types_pb2.KvCacheDescription
    ucx_address: bytes
    num_active_requests: int
    device: str
    kv_shared_memory: KvSharedMemory
    speculative: SpeculativeDecoding
    tensor_parallel_size: int
    rank_kv_shared_memory: _containers.RepeatedCompositeFieldContainer[KvSharedMemory]
    pipeline_parallel_size: int
    rank_ucx_addresses: _containers.RepeatedScalarFieldContainer[bytes]
    max_loras: int
    boot_id: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_types_pb2.WorkerRole, str]] = ..., model: _Optional[_Union[_types_pb2.ModelDescription, _Mapping]] = ..., kv_cache: _Optional[_Union[_types_pb2.KvCacheDescription, _Mapping]] = ..., ucx_address: _Optional[bytes] = ..., num_active_requests: _Optional[int] = ..., device: _Optional[str] = ..., kv_shared_memory: _Optional[_Union[KvSharedMemory, _Mapping]] = ..., speculative: _Optional[_Union[SpeculativeDecoding, _Mapping]] = ..., tensor_parallel_size: _Optional[int] = ..., rank_kv_shared_memory: _Optional[_Iterable[_Union[KvSharedMemory, _Mapping]]] = ..., pipeline_parallel_size: _Optional[int] = ..., rank_ucx_addresses: _Optional[_Iterable[bytes]] = ..., max_loras: _Optional[int] = ..., boot_id: _Optional[str] = ...) -> None: ...

class SpeculativeDecoding(_message.Message):
    __slots__ = ("method", "num_speculative_tokens", "disable_by_batch_size")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_BY_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    method: str
    num_speculative_tokens: int
    disable_by_batch_size: int
    def __init__(self, method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., disable_by_batch_size: _Optional[int] = ...) -> None: ...

class KvSharedMemory(_message.Message):
    __slots__ = ("host_id", "pid", "fd", "num_bytes", "token", "pool_offset")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    POOL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    pid: int
    fd: int
    num_bytes: int
    token: bytes
    pool_offset: int
    def __init__(self, host_id: _Optional[str] = ..., pid: _Optional[int] = ..., fd: _Optional[int] = ..., num_bytes: _Optional[int] = ..., token: _Optional[bytes] = ..., pool_offset: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_requests", "finished_request_ids", "swap_out", "swap_in", "block_copies", "cancelled_transfer_tags", "offload_in", "offload_out", "disk_saves", "disk_loads", "disk_retains", "kv_loads", "await_kv")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_TRANSFER_TAGS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_IN_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_OUT_FIELD_NUMBER: _ClassVar[int]
    DISK_SAVES_FIELD_NUMBER: _ClassVar[int]
    DISK_LOADS_FIELD_NUMBER: _ClassVar[int]
    DISK_RETAINS_FIELD_NUMBER: _ClassVar[int]
    KV_LOADS_FIELD_NUMBER: _ClassVar[int]
    AWAIT_KV_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    block_copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    cancelled_transfer_tags: _containers.RepeatedScalarFieldContainer[int]
    offload_in: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    offload_out: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    disk_saves: _containers.RepeatedCompositeFieldContainer[DiskBlock]
    disk_loads: _containers.RepeatedCompositeFieldContainer[DiskBlock]
    disk_retains: _containers.RepeatedCompositeFieldContainer[DiskRetain]
    kv_loads: _containers.RepeatedCompositeFieldContainer[KvLoad]
    await_kv: bool
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., swap_out: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., block_copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., cancelled_transfer_tags: _Optional[_Iterable[int]] = ..., offload_in: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., offload_out: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., disk_saves: _Optional[_Iterable[_Union[DiskBlock, _Mapping]]] = ..., disk_loads: _Optional[_Iterable[_Union[DiskBlock, _Mapping]]] = ..., disk_retains: _Optional[_Iterable[_Union[DiskRetain, _Mapping]]] = ..., kv_loads: _Optional[_Iterable[_Union[KvLoad, _Mapping]]] = ..., await_kv: _Optional[bool] = ...) -> None: ...

class KvLoad(_message.Message):
    __slots__ = ("transfer_tag", "block_ids", "source", "sender_tensor_parallel_size", "sender_pipeline_parallel_size", "traceparent", "tracestate")
    TRANSFER_TAG_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SENDER_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SENDER_PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    transfer_tag: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    source: KvSource
    sender_tensor_parallel_size: int
    sender_pipeline_parallel_size: int
    traceparent: str
    tracestate: str
    def __init__(self, transfer_tag: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., source: _Optional[_Union[KvSource, _Mapping]] = ..., sender_tensor_parallel_size: _Optional[int] = ..., sender_pipeline_parallel_size: _Optional[int] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class KvLoadDone(_message.Message):
    __slots__ = ("transfer_tag", "num_bytes", "seconds", "source_lag_seconds", "error", "pull_refused")
    TRANSFER_TAG_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PULL_REFUSED_FIELD_NUMBER: _ClassVar[int]
    transfer_tag: int
    num_bytes: int
    seconds: float
    source_lag_seconds: float
    error: str
    pull_refused: bool
    def __init__(self, transfer_tag: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., source_lag_seconds: _Optional[float] = ..., error: _Optional[str] = ..., pull_refused: _Optional[bool] = ...) -> None: ...

class DiskBlock(_message.Message):
    __slots__ = ("block_hash", "root", "offload_block", "retain_until")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_BLOCK_FIELD_NUMBER: _ClassVar[int]
    RETAIN_UNTIL_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    root: bytes
    offload_block: int
    retain_until: float
    def __init__(self, block_hash: _Optional[bytes] = ..., root: _Optional[bytes] = ..., offload_block: _Optional[int] = ..., retain_until: _Optional[float] = ...) -> None: ...

class DiskRetain(_message.Message):
    __slots__ = ("block_hash", "retain_until")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    RETAIN_UNTIL_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    retain_until: float
    def __init__(self, block_hash: _Optional[bytes] = ..., retain_until: _Optional[float] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "sampling", "num_prompt_tokens", "num_lookahead_tokens", "lora_name", "structured_output", "traceparent", "tracestate")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: _types_pb2.Sampling
    num_prompt_tokens: int
    num_lookahead_tokens: int
    lora_name: str
    structured_output: _generate_pb2.StructuredOutput
    traceparent: str
    tracestate: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_types_pb2.Sampling, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_lookahead_tokens: _Optional[int] = ..., lora_name: _Optional[str] = ..., structured_output: _Optional[_Union[_generate_pb2.StructuredOutput, _Mapping]] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("request_id", "new_block_ids", "num_scheduled_tokens", "block_table", "num_lookahead_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    num_lookahead_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., num_lookahead_tokens: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "sampled_tokens", "execute_seconds", "prompt_logprobs", "spec_decode", "draining", "propose_seconds", "propose_passes", "disk_loaded", "disk_failed", "disk_removed", "offload_load_seconds", "disk_read_seconds", "kv_loads_done")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_PASSES_FIELD_NUMBER: _ClassVar[int]
    DISK_LOADED_FIELD_NUMBER: _ClassVar[int]
    DISK_FAILED_FIELD_NUMBER: _ClassVar[int]
    DISK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_LOADS_DONE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    execute_seconds: float
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    spec_decode: _containers.RepeatedCompositeFieldContainer[SpecDecodeCounts]
    draining: bool
    propose_seconds: float
    propose_passes: int
    disk_loaded: _containers.RepeatedScalarFieldContainer[bytes]
    disk_failed: _containers.RepeatedScalarFieldContainer[bytes]
    disk_removed: _containers.RepeatedScalarFieldContainer[bytes]
    offload_load_seconds: float
    disk_read_seconds: float
    kv_loads_done: _containers.RepeatedCompositeFieldContainer[KvLoadDone]
    def __init__(self, step_id: _Optional[int] = ..., sampled_tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., execute_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., spec_decode: _Optional[_Iterable[_Union[SpecDecodeCounts, _Mapping]]] = ..., draining: _Optional[bool] = ..., propose_seconds: _Optional[float] = ..., propose_passes: _Optional[int] = ..., disk_loaded: _Optional[_Iterable[bytes]] = ..., disk_failed: _Optional[_Iterable[bytes]] = ..., disk_removed: _Optional[_Iterable[bytes]] = ..., offload_load_seconds: _Optional[float] = ..., disk_read_seconds: _Optional[float] = ..., kv_loads_done: _Optional[_Iterable[_Union[KvLoadDone, _Mapping]]] = ...) -> None: ...

class SpecDecodeCounts(_message.Message):
    __slots__ = ("request_id", "num_draft_tokens", "num_accepted_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_draft_tokens: int
    num_accepted_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("request_id", "start", "entries")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start: int
    entries: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., start: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("request_id", "token_id", "logprob")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    logprob: _generate_pb2.TokenLogprob
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[_Union[_generate_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class SendKvRequest(_message.Message):
    __slots__ = ("transfer_tag", "peer_worker_id", "peer_ucx_address", "block_ids", "peer_tensor_parallel_size", "peer_pipeline_parallel_size", "peer_rank_ucx_addresses")
    TRANSFER_TAG_FIELD_NUMBER: _ClassVar[int]
    PEER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PEER_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PEER_PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PEER_RANK_UCX_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    transfer_tag: int
    peer_worker_id: str
    peer_ucx_address: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    peer_tensor_parallel_size: int
    peer_pipeline_parallel_size: int
    peer_rank_ucx_addresses: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, transfer_tag: _Optional[int] = ..., peer_worker_id: _Optional[str] = ..., peer_ucx_address: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., peer_tensor_parallel_size: _Optional[int] = ..., peer_pipeline_parallel_size: _Optional[int] = ..., peer_rank_ucx_addresses: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SendKvResponse(_message.Message):
    __slots__ = ("num_bytes", "seconds")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    seconds: float
    def __init__(self, num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class KvSource(_message.Message):
    __slots__ = ("worker_id", "shared_memory", "block_ids", "ready_step_id", "tensor_parallel_size", "rank_shared_memory", "pipeline_parallel_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    READY_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    shared_memory: KvSharedMemory
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    ready_step_id: int
    tensor_parallel_size: int
    rank_shared_memory: _containers.RepeatedCompositeFieldContainer[KvSharedMemory]
    pipeline_parallel_size: int
    def __init__(self, worker_id: _Optional[str] = ..., shared_memory: _Optional[_Union[KvSharedMemory, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., ready_step_id: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., rank_shared_memory: _Optional[_Iterable[_Union[KvSharedMemory, _Mapping]]] = ..., pipeline_parallel_size: _Optional[int] = ...) -> None: ...

class AddLoraRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class AddLoraResponse(_message.Message):
    __slots__ = ("lora_adapters",)
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class RemoveLoraRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class RemoveLoraResponse(_message.Message):
    __slots__ = ("lora_adapters",)
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class PrepareStructuredOutputRequest(_message.Message):
    __slots__ = ("structured_output",)
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    structured_output: _generate_pb2.StructuredOutput
    def __init__(self, structured_output: _Optional[_Union[_generate_pb2.StructuredOutput, _Mapping]] = ...) -> None: ...

class PrepareStructuredOutputResponse(_message.Message):
    __slots__ = ("seconds",)
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    def __init__(self, seconds: _Optional[float] = ...) -> None: ...
