from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_BOTH: WorkerRole
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ...) -> None: ...

class ModelDescription(_message.Message):
    __slots__ = ("name", "architecture", "vocab_size", "max_model_len", "eos_token_ids", "dtype", "num_layers", "num_kv_heads", "head_dim")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class KvCacheDescription(_message.Message):
    __slots__ = ("num_blocks", "block_size", "block_bytes", "layout", "num_swap_blocks")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    block_bytes: int
    layout: str
    num_swap_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., block_bytes: _Optional[int] = ..., layout: _Optional[str] = ..., num_swap_blocks: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...
