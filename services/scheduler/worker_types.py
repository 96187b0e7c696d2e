"""What the scheduler knows about a worker, free of grpc and protobuf: its description,
a step's result, the error a broken worker raises, and the `WorkerConnection` protocol a
pool talks to (`worker_client.WorkerClient` over gRPC; a fake in the unit tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from common.kv_shared_memory import SharedMemoryInfo
from common.rope_config import prompt_rope_key
from common.step_result import KvLoadDone, StepResult
from common.structured_output import Constraint
from services.scheduler.step_plan import PoolStepPlan


class WorkerUnavailableError(RuntimeError):
    """The worker's Step stream or a KV call failed: the worker is gone or broken."""


class ConstraintRefusedError(ValueError):
    """A worker could not compile a structured-output constraint (the message says why)."""


class LoraRefusedError(ValueError):
    """A worker refused to load a LoRA adapter: `code` is the gRPC status name
    (INVALID_ARGUMENT: the folder is not an adapter it can apply; FAILED_PRECONDITION: it
    runs without --enable-lora), the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class KvPullRefusedError(WorkerUnavailableError):
    """The receiving worker cannot map the source's shared pool (e.g. another user): KV
    between these two workers has to go over UCX."""


@dataclass(frozen=True)
class ModelShape:
    """The model a worker serves, as far as the scheduler and the gateway care."""

    name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    lora_adapters: tuple[str, ...] = ()  # the LoRA adapters every worker loaded
    rope_type: str = ""  # the RoPE scaling type ("" from a worker that does not say)
    rope_length_threshold: int = 0  # see common.rope_config.rope_length_threshold
    # Each KV group's sliding window (0: full attention; `common.kv_groups`); (): one group.
    kv_group_windows: tuple[int, ...] = ()

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """Each KV group's window for the block manager (None: full attention)."""
        return tuple(w or None for w in self.kv_group_windows) or (None,)

    def prompt_rope_key(self, prompt_len: int) -> str:
        """The RoPE state a prompt of `prompt_len` tokens is computed under, beyond its
        tokens (length-dependent RoPE; "" for most models): part of its prefix-cache root."""
        return prompt_rope_key(self.rope_type, self.rope_length_threshold, prompt_len)


@dataclass(frozen=True)
class WorkerLimits:
    """Worker settings the scheduler's own must agree with (sent beside DescribeWorker; None
    where the worker did not send one): the tokens of the largest step it profiled
    activation memory for (GPU workers only), and its KV transfer timeout."""

    profile_num_tokens: int | None = None
    kv_transfer_timeout_s: float | None = None


@dataclass(frozen=True)
class SpeculativeInfo:
    """A worker's speculative decoding: its method, the proposals it verifies per request
    and step (the lookahead slots to plan), and the batch size from which it is off."""

    method: str
    num_speculative_tokens: int
    disable_by_batch_size: int = 0  # 0: never off


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    address: str
    role: str  # "prefill", "decode" or "both"
    model: ModelShape
    num_blocks: int
    block_size: int
    block_bytes: int
    ucx_address: bytes
    num_swap_blocks: int = 0
    limits: WorkerLimits | None = None  # None: an older worker that sends no limits
    # Its KV pool in shared memory, when it has one (a CPU worker): same-host peers pull.
    shared_memory: SharedMemoryInfo | None = None
    speculative: SpeculativeInfo | None = None
    # Tensor-parallel ranks, and the shared pools of ranks 1.. (shared_memory is rank 0's).
    tensor_parallel_size: int = 1
    rank_shared_memory: tuple[SharedMemoryInfo, ...] = ()
    pipeline_parallel_size: int = 1
    rank_ucx_addresses: tuple[bytes, ...] = ()  # ranks 1.. (ucx_address is rank 0's)
    max_loras: int = 0  # distinct LoRA adapters per step (0: LoRA off)
    num_offload_cpu_blocks: int = 0  # the host-memory KV offload tier
    num_offload_disk_blocks: int = 0  # the disk tier behind it
    offload_disk_hashes: tuple[bytes, ...] = ()  # what it holds (oldest first)
    boot_id: str = ""  # random per worker process ('' : unknown): a change is a restart


class WorkerConnection(Protocol):
    """What a pool needs from its worker. Every call raises WorkerUnavailableError when
    the worker is gone or broken."""

    address: str

    async def health(self, timeout_s: float) -> str:
        """grpc.health.v1 status name ('SERVING', 'NOT_SERVING') or 'UNREACHABLE'."""

    async def health_boot(self, timeout_s: float) -> tuple[str, str]:
        """`health`'s status and the worker process's boot id ('' when unknown)."""

    async def wait_ready(self, timeout_s: float) -> WorkerInfo: ...

    async def open_step_stream(self) -> None:
        """A new step stream: the worker forgets its batch; step ids restart at 1."""

    def close_step_stream(self) -> None: ...

    async def send_step(self, plan: PoolStepPlan) -> int:
        """Write a plan on the step stream without waiting for its result; its id."""

    async def receive_step(self) -> StepResult:
        """The result of the oldest step sent and not yet answered."""

    async def send_kv(
        self, tag: int, peer: WorkerInfo, block_ids: list[int], timeout_s: float
    ) -> KvLoadDone: ...

    async def add_lora(self, name: str, path: str, timeout_s: float) -> None:
        """Hold the adapter in folder `path` as `name` (LoraRefusedError when it cannot)."""

    async def remove_lora(self, name: str, timeout_s: float) -> None: ...

    async def prepare_structured(self, constraint: Constraint, timeout_s: float) -> None:
        """Compile `constraint` off the worker's step thread (ConstraintRefusedError when it
        does not compile, WorkerUnavailableError when the worker does not answer)."""

    async def close(self) -> None: ...
