"""Settings of a worker process (`python -m services.worker --help`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import check_port, parse_size, setting
from services.worker.models.attention_backend import BACKENDS

ROLES = ("prefill", "decode", "both")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class WorkerConfig:
    """A Tandem worker: model weights, a paged KV pool, step execution and KV transfer."""

    model: str = setting("", "model folder (Hugging Face layout)", env="TANDEM_MODEL")
    role: str = setting(
        "both", "which phases this worker runs", choices=ROLES, env="TANDEM_WORKER_ROLE"
    )
    host: str = setting(
        "127.0.0.1", "listen address (loopback by default)", env="TANDEM_WORKER_HOST"
    )
    port: int = setting(50061, "listen port (0 = any free port)", env="TANDEM_WORKER_PORT")
    worker_id: str = setting(
        "", "stable id of this worker (default: <role>-<port>)", env="TANDEM_WORKER_ID"
    )
    device: str = setting(
        "auto", "torch device: auto, cpu, cuda, cuda:N", env="TANDEM_WORKER_DEVICE"
    )
    dtype: str = setting(
        "auto",
        "weights and KV dtype (auto: float32 on CPU, the checkpoint's dtype on GPU)",
        choices=DTYPES,
        env="TANDEM_DTYPE",
    )
    attention_backend: str = setting(
        "auto",
        "paged attention: auto (Triton on CUDA, cpu elsewhere), cpu (C++ decode kernel + "
        "SDPA), torch (the plain reference) or triton",
        choices=BACKENDS,
        env="TANDEM_ATTENTION_BACKEND",
    )
    enforce_eager: bool = setting(
        False,
        "never capture CUDA graphs (decode steps run eagerly)",
        env="TANDEM_ENFORCE_EAGER",
    )
    cuda_graph_max_batch_size: int = setting(
        256,
        "largest decode batch replayed from a CUDA graph (larger ones run eagerly)",
        env="TANDEM_CUDA_GRAPH_MAX_BATCH_SIZE",
    )
    profile_num_tokens: int = setting(
        2048,
        "tokens of the largest step, profiled on GPU to leave room for activations "
        "(match the scheduler's max_num_batched_tokens)",
        env="TANDEM_PROFILE_NUM_TOKENS",
    )
    block_size: int = setting(16, "tokens per KV block", env="TANDEM_BLOCK_SIZE")
    num_blocks: int = setting(
        0, "KV blocks in the pool (0 = size from kv_cache_memory)", env="TANDEM_WORKER_NUM_BLOCKS"
    )
    kv_cache_memory: str = setting(
        "512MiB",
        "memory for the KV pool when num_blocks is 0 "
        "(CPU); on GPU the pool takes gpu_memory_utilization",
        env="TANDEM_KV_CACHE_MEMORY",
    )
    swap_space: str = setting(
        "512MiB",
        "CPU memory for swap preemption (0 = none); untouched until the scheduler swaps",
        env="TANDEM_SWAP_SPACE",
    )
    gpu_memory_utilization: float = setting(
        0.9, "fraction of GPU memory for weights and KV", env="TANDEM_GPU_MEMORY_UTILIZATION"
    )
    max_model_len: int = setting(
        0, "cap on prompt + output tokens (0 = the model's)", env="TANDEM_MAX_MODEL_LEN"
    )
    torch_threads: int = setting(
        0, "torch intra-op threads (0 = torch's default)", env="TANDEM_WORKER_TORCH_THREADS"
    )
    cpu_packed_weights: str = setting(
        "auto",
        "also keep MKL-packed float32 weights for decode-sized batches (up to 30% faster "
        "decode steps, ~2.6x the weights' memory): auto (decode and both workers on CPU when "
        "they fit in half the available memory), on, off",
        choices=("auto", "on", "off"),
        env="TANDEM_CPU_PACKED_WEIGHTS",
    )
    cpu_compute_lock: str = setting(
        "auto",
        "take turns computing with the other CPU workers on this host: auto (a host-wide lock "
        "file for CPU workers, none on GPU), off, or the path of a lock file to share",
        env="TANDEM_CPU_COMPUTE_LOCK",
    )
    kv_transfer_timeout_s: float = setting(
        60.0, "seconds before a KV send/receive fails", env="TANDEM_KV_TRANSFER_TIMEOUT_S"
    )
    kv_transfer_error_handling: bool = setting(
        True,
        "UCX peer-failure detection: on = a peer that dies mid-transfer fails that transfer "
        "only (UCX uses transports that detect it: TCP between hosts' CPUs, RDMA); off = "
        "shared memory between same-host workers, several times faster, but a sender dying "
        "mid-transfer can abort the receiving worker",
        env="TANDEM_KV_TRANSFER_ERROR_HANDLING",
    )
    drain_timeout_s: float = setting(
        30.0,
        "on SIGTERM: seconds to let the requests this worker holds finish",
        env="TANDEM_DRAIN_TIMEOUT_S",
    )
    log_level: str = setting("info", "debug, info, warning or error", env="TANDEM_LOG_LEVEL")

    def __post_init__(self) -> None:
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not self.model:
            raise ValueError("model is required: --model FOLDER or TANDEM_MODEL")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check_port(self.port, "port")
        if not 1 <= self.block_size <= 1024 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in 1..1024, got {self.block_size}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {self.num_blocks}")
        if parse_size(self.kv_cache_memory) <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
        if parse_size(self.swap_space) < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if not 1 <= self.cuda_graph_max_batch_size <= 1024:
            raise ValueError(
                "cuda_graph_max_batch_size must be in 1..1024, "
                f"got {self.cuda_graph_max_batch_size}"
            )
        if self.profile_num_tokens < 1:
            raise ValueError(f"profile_num_tokens must be >= 1, got {self.profile_num_tokens}")
        if self.cpu_packed_weights not in ("auto", "on", "off"):
            raise ValueError(
                f"cpu_packed_weights must be auto, on or off, got {self.cpu_packed_weights!r}"
            )
        if not self.cpu_compute_lock:
            raise ValueError("cpu_compute_lock must be auto, off or a file path")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0, got {self.torch_threads}")
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError(
                f"kv_transfer_timeout_s must be positive, got {self.kv_transfer_timeout_s}"
            )

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{self.role}-{self.port}"
