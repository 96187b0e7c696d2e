from common.pb.tandem.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_BOTH: WorkerRole

class Sampling(_message.Message):
    __slots__ = ("params", "min_tokens", "stop_token_ids", "logprobs", "prompt_logprobs")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    params: _generate_pb2.SamplingParams
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    prompt_logprobs: int
    def __init__(self, params: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class ModelDescription(_message.Message):
    __slots__ = ("name", "architecture", "vocab_size", "max_model_len", "eos_token_ids", "dtype", "num_layers", "num_kv_heads", "head_dim", "lora_adapters", "rope_type", "rope_length_threshold", "kv_group_windows")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ROPE_TYPE_FIELD_NUMBER: _ClassVar[int]
    ROPE_LENGTH_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    rope_type: str
    rope_length_threshold: int
    kv_group_windows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., rope_type: _Optional[str] = ..., rope_length_threshold: _Optional[int] = ..., kv_group_windows: _Optional[_Iterable[int]] = ...) -> None: ...

class KvCacheDescription(_message.Message):
    __slots__ = ("num_blocks", "block_size", "block_bytes", "layout", "num_swap_blocks", "num_offload_cpu_blocks", "num_offload_disk_blocks", "offload_disk_hashes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOAD_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOAD_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_DISK_HASHES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    block_bytes: int
    layout: str
    num_swap_blocks: int
    num_offload_cpu_blocks: int
    num_offload_disk_blocks: int
    offload_disk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., block_bytes: _Optional[int] = ..., layout: _Optional[str] = ..., num_swap_blocks: _Optional[int] = ..., num_offload_cpu_blocks: _Optional[int] = ..., num_offload_disk_blocks: _Optional[int] = ..., offload_disk_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...
