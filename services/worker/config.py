"""Settings of a worker process (`python -m services.worker --help`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import (
    ServiceConfig,
    drain_timeout_setting,
    host_setting,
    log_level_setting,
    metrics_port_setting,
    model_setting,
    port_setting,
    setting,
    tokenizer_setting,
)
from common.kv_offloading_config import parse_offloading
from common.parallel_plan import Layout
from common.speculative_config import SpeculativeConfig, parse_speculative_config
from services.worker.models.attention_backend import BACKENDS
from services.worker.models.gemm_plan import CHOICES as GEMM_CHOICES
from services.worker.models.quantized_weights import MATMUL_CHOICES

ROLES = ("prefill", "decode", "both")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's names: auto = the model's dtype; fp8 = fp8_e4m3 (per-tensor or per-head scales).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
PACKED_WEIGHTS = ("auto", "on", "off")


@dataclass(frozen=True)
class WorkerConfig(ServiceConfig):
    """A Tandem worker: model weights, a paged KV pool, step execution and KV transfer."""

    model: str = model_setting("model: a Hugging Face folder, or a GGUF file (dequantized)")
    tokenizer: str = tokenizer_setting()
    role: str = setting(
        "both", "which phases this worker runs", choices=ROLES, env="TANDEM_WORKER_ROLE"
    )
    host: str = host_setting("TANDEM_WORKER_HOST")
    port: int = port_setting(50061, "TANDEM_WORKER_PORT")
    metrics_port: int = metrics_port_setting("TANDEM_WORKER_METRICS_PORT")
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
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache dtype: auto (the model's dtype) or fp8 / fp8_e4m3 (one byte per entry: "
        "2x the blocks of bf16, 4x of fp32 in the same memory; scaled by the checkpoint's "
        "k_scale/v_scale where it has them, else 1.0)",
        choices=KV_CACHE_DTYPES,
        env="TANDEM_KV_CACHE_DTYPE",
    )
    quantized_matmul: str = setting(
        "auto",
        "how a quantized checkpoint's layers run: triton (kept packed, Triton weight-only "
        "matmuls; one process, CUDA), dense (dequantized at load) or auto (triton on CUDA "
        "without tensor parallelism or LoRA, else dense)",
        choices=MATMUL_CHOICES,
        env="TANDEM_QUANTIZED_MATMUL",
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
    disable_hybrid_kv_cache_manager: bool = setting(
        False,
        "models mixing sliding-window and full layers (Gemma 2/3, gpt-oss, Qwen2 "
        "max_window_layers): keep one block table for all layers (every block of the "
        "context held on every layer) instead of a table per KV group whose windowed "
        "groups free the blocks out of their window (vLLM's flag)",
        env="TANDEM_DISABLE_HYBRID_KV_CACHE_MANAGER",
    )
    cuda_graph_max_batch_size: int = setting(
        256,
        "largest decode batch replayed from a CUDA graph (larger ones run eagerly)",
        env="TANDEM_CUDA_GRAPH_MAX_BATCH_SIZE",
    )
    profile_num_tokens: int = setting(
        2048,
        "tokens of the largest step, profiled on GPU to leave room for activations; must "
        "be >= the scheduler's --max-num-batched-tokens (checked when the scheduler connects)",
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
    kv_offload_cpu_bytes: str = setting(
        "0",
        "host memory for the KV offload tier (0 = none): full blocks are saved there and a "
        "prefix the pool evicted is loaded back instead of recomputed",
        env="TANDEM_KV_OFFLOAD_CPU_BYTES",
    )
    kv_offload_dir: str = setting(
        "",
        'folder of the KV offload\'s disk tier, behind the host-memory tier ("": none); '
        "it survives a restart",
        env="TANDEM_KV_OFFLOAD_DIR",
    )
    kv_offload_disk_bytes: str = setting(
        "0",
        "disk budget of the KV offload's disk tier (with --kv-offload-dir)",
        env="TANDEM_KV_OFFLOAD_DISK_BYTES",
    )
    kv_offloading_size: float = setting(
        0.0,
        "vLLM's --kv-offloading-size: GiB of host memory for the KV offload tier (0 = none; "
        "the same as --kv-offload-cpu-bytes, common/kv_offloading_config.py)",
        env="TANDEM_KV_OFFLOADING_SIZE",
    )
    kv_offloading_backend: str = setting(
        "native",
        "vLLM's --kv-offloading-backend: native (Tandem's tiers; lmcache is refused)",
        env="TANDEM_KV_OFFLOADING_BACKEND",
    )
    kv_transfer_config: str = setting(
        "",
        'vLLM\'s --kv-transfer-config JSON with kv_connector "OffloadingConnector": '
        "cpu_bytes_to_use, and an fs secondary tier (root_dir, max_bytes) for a disk tier",
        env="TANDEM_KV_TRANSFER_CONFIG",
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
        "also keep packed float32 weights for the row counts where they beat torch.mm at load "
        "(30-50% faster decode steps, 7-28% faster prompts with Tandem's panels; oneDNN's or "
        "Tandem's copy takes the weights' memory again, MKL's ~2.6x): auto (CPU workers "
        "whose copies fit in half the available memory), on, off",
        choices=PACKED_WEIGHTS,
        env="TANDEM_CPU_PACKED_WEIGHTS",
    )
    cpu_gemm: str = setting(
        "auto",
        "which packed GEMM those weights use: auto (time MKL's, oneDNN's and Tandem's own "
        "C++ kernel on the model's weights at load, keep the fastest and the batch sizes "
        "where it beats torch.mm), mkl, onednn, tandem",
        choices=GEMM_CHOICES,
        env="TANDEM_CPU_GEMM",
    )
    cpu_compute_lock: str = setting(
        "auto",
        "take turns computing with the other CPU workers on this host: auto (a host-wide lock "
        "file for CPU workers, none on GPU), off, or the path of a lock file to share",
        env="TANDEM_CPU_COMPUTE_LOCK",
    )
    kv_transfer_timeout_s: float = setting(
        60.0,
        "seconds before a KV send/receive over UCX fails; must be <= the scheduler's "
        "--kv-transfer-timeout-s, the deadline of the whole transfer call (lower, the worker "
        "reports a stuck transfer itself; checked when the scheduler connects)",
        env="TANDEM_KV_TRANSFER_TIMEOUT_S",
    )
    kv_transfer_base_timeout_s: float = setting(
        5.0,
        "seconds a UCX KV send may take on top of its bytes at --kv-transfer-min-rate-mb-s "
        "(a receive twice this): a link cut mid-transfer fails it in about this time, and "
        "the request is recomputed on another decode worker; capped by "
        "--kv-transfer-timeout-s",
        env="TANDEM_KV_TRANSFER_BASE_TIMEOUT_S",
    )
    kv_transfer_min_rate_mb_s: float = setting(
        25.0,
        "the slowest a link may carry KV (MB/s) before a transfer over it counts as failed",
        env="TANDEM_KV_TRANSFER_MIN_RATE_MB_S",
    )
    kv_transfer_error_handling: bool = setting(
        True,
        "UCX peer-failure detection: on = a peer that dies mid-transfer fails that transfer "
        "only (UCX uses transports that detect it: TCP between hosts' CPUs, RDMA); off = "
        "shared memory between same-host workers, several times faster, but a sender dying "
        "mid-transfer can abort the receiving worker",
        env="TANDEM_KV_TRANSFER_ERROR_HANDLING",
    )
    kv_transfer_shared_memory: bool = setting(
        True,
        "keep a CPU worker's KV pool in shared memory (a memfd): a same-host peer copies "
        "blocks straight out of it, layer by layer while they are computed, instead of over "
        "UCX; off = every transfer uses UCX",
        env="TANDEM_KV_TRANSFER_SHARED_MEMORY",
    )
    kv_transfer_stream_min_copy_bytes: int = setting(
        2 << 20,
        "while a peer still computes a prompt's KV, copy its finished layers once at least "
        "this many bytes of them are ready (smaller transfers are copied once, at the end)",
        env="TANDEM_KV_TRANSFER_STREAM_MIN_COPY_BYTES",
    )
    structured_outputs_disable_any_whitespace: bool = setting(
        False,
        "JSON outputs (json_schema, json_object) hold single spaces after ',' and ':' only "
        "(vLLM's structured_outputs_config.disable_any_whitespace); default: any whitespace, "
        "as vLLM",
        env="TANDEM_STRUCTURED_OUTPUTS_DISABLE_ANY_WHITESPACE",
    )
    speculative_config: str = setting(
        "",
        'speculative decoding, vLLM\'s JSON: e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (decode workers; '
        "empty = off)",
        env="TANDEM_SPECULATIVE_CONFIG",
    )
    enable_lora: bool = setting(
        False, "serve LoRA adapters (vLLM's --enable-lora)", env="TANDEM_ENABLE_LORA"
    )
    lora_modules: tuple[str, ...] = setting(
        (),
        "LoRA adapters to load at start, name=path of a PEFT adapter folder, comma-separated "
        "(vLLM's --lora-modules); requests pick one by name",
        env="TANDEM_LORA_MODULES",
    )
    max_loras: int = setting(
        1,
        "distinct LoRA adapters one step may use (vLLM's --max-loras; the scheduler batches "
        "within it)",
        env="TANDEM_MAX_LORAS",
    )
    max_lora_rank: int = setting(
        16, "largest LoRA rank accepted (vLLM's --max-lora-rank, <= 64)", env="TANDEM_MAX_LORA_RANK"
    )
    max_cpu_loras: int = setting(
        0,
        "LoRA adapters held in memory (vLLM's --max-cpu-loras; 0 = max_loras or the number "
        "of --lora-modules, whichever is larger); the least recently used beyond it are "
        "read again from their folder when a step needs them",
        env="TANDEM_MAX_CPU_LORAS",
    )
    tensor_parallel_size: int = setting(
        1,
        "ranks that each hold a slice of every layer (attention heads, MLP, vocabulary); the "
        "worker starts the other ranks itself (gloo on CPU, NCCL on GPU)",
        env="TANDEM_TENSOR_PARALLEL_SIZE",
    )
    pipeline_parallel_size: int = setting(
        1,
        "stages that each hold a contiguous range of decoder layers (ranks = tensor x "
        "pipeline size; the last stage samples)",
        env="TANDEM_PIPELINE_PARALLEL_SIZE",
    )
    enable_expert_parallel: bool = setting(
        False,
        "mixture-of-experts models: split the experts whole over the tensor-parallel ranks "
        "instead of slicing every expert (vLLM's --enable-expert-parallel); the number of "
        "experts must be a multiple of the ranks",
        env="TANDEM_ENABLE_EXPERT_PARALLEL",
    )
    drain_timeout_s: float = drain_timeout_setting(
        "on SIGTERM: seconds to let the requests this worker holds finish"
    )
    log_level: str = log_level_setting()

    def __post_init__(self) -> None:
        self._check_service()
        if not self.model:
            raise ValueError("model is required: --model FOLDER or TANDEM_MODEL")
        for name, choices in (
            ("role", ROLES),
            ("dtype", DTYPES),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("quantized_matmul", MATMUL_CHOICES),
            ("attention_backend", BACKENDS),
            ("cpu_packed_weights", PACKED_WEIGHTS),
            ("cpu_gemm", GEMM_CHOICES),
        ):
            self._require(
                getattr(self, name) in choices, name, f"must be one of {', '.join(choices)}"
            )
        self._require(
            1 <= self.block_size <= 1024 and not self.block_size & (self.block_size - 1),
            "block_size",
            "must be a power of two in 1..1024",
        )
        self._at_least(0, "num_blocks", "max_model_len", "torch_threads")
        self._require(self._size("kv_cache_memory") > 0, "kv_cache_memory", "must be positive")
        self._require(self._size("swap_space") >= 0, "swap_space", "must be >= 0")
        self._take_vllm_offloading()
        self._require(
            self._size("kv_offload_cpu_bytes") >= 0, "kv_offload_cpu_bytes", "must be >= 0"
        )
        disk = self._size("kv_offload_disk_bytes")
        self._require(disk >= 0, "kv_offload_disk_bytes", "must be >= 0")
        self._require(
            bool(disk) == bool(self.kv_offload_dir),
            "kv_offload_dir",
            "and --kv-offload-disk-bytes go together (a folder and its budget)",
        )
        self._require(
            not disk or self._size("kv_offload_cpu_bytes") > 0,
            "kv_offload_disk_bytes",
            "needs --kv-offload-cpu-bytes (the disk tier is behind the host-memory tier)",
        )
        self._require(
            0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]"
        )
        self._require(
            1 <= self.cuda_graph_max_batch_size <= 1024,
            "cuda_graph_max_batch_size",
            "must be in 1..1024",
        )
        self._at_least(1, "profile_num_tokens")
        self._require(
            bool(self.cpu_compute_lock), "cpu_compute_lock", "must be auto, off or a file path"
        )
        self._positive(
            "kv_transfer_timeout_s", "kv_transfer_base_timeout_s", "kv_transfer_min_rate_mb_s"
        )
        self._at_least(0, "kv_transfer_stream_min_copy_bytes")
        spec = parse_speculative_config(self.speculative_config)  # one clear line if bad
        if spec is not None and self.role == "prefill":
            raise ValueError("--speculative-config is for decode (or both) workers")
        self._at_least(1, "tensor_parallel_size", "pipeline_parallel_size")
        self._check_lora(spec)
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) == 1:
                continue
            self._require(
                spec is None, name, "must be 1 with --speculative-config (not combined yet)"
            )

    def _take_vllm_offloading(self) -> None:
        """vLLM's offloading flags become Tandem's tier settings (one shape from here on;
        the vLLM ones are cleared, so a `dataclasses.replace` sees Tandem's only)."""
        tiers = parse_offloading(
            self.kv_transfer_config, self.kv_offloading_size, self.kv_offloading_backend
        )
        if tiers is None:
            return
        own = ("kv_offload_cpu_bytes", "kv_offload_disk_bytes")
        if any(self._size(name) for name in own) or self.kv_offload_dir:
            raise ValueError(
                "--kv-transfer-config / --kv-offloading-size cannot be combined with "
                "--kv-offload-cpu-bytes, --kv-offload-dir or --kv-offload-disk-bytes (give "
                "the tiers one way)"
            )
        for name, value in (
            ("kv_offload_cpu_bytes", str(tiers.cpu_bytes)),
            ("kv_offload_dir", tiers.disk_dir),
            ("kv_offload_disk_bytes", str(tiers.disk_bytes)),
            ("kv_transfer_config", ""),
            ("kv_offloading_size", 0.0),
        ):
            object.__setattr__(self, name, value)

    def _check_lora(self, spec) -> None:
        self._at_least(1, "max_loras")
        self._at_least(0, "max_cpu_loras")
        self._require(1 <= self.max_lora_rank <= 64, "max_lora_rank", "must be in 1..64")
        if not self.enable_lora:
            self._require(not self.lora_modules, "lora_modules", "needs --enable-lora")
            return
        names = [m.partition("=")[0] for m in self.lora_modules]
        for module in self.lora_modules:
            name, sep, path = module.partition("=")
            self._require(bool(sep and name and path), "lora_modules", "entries are name=path")
        self._require(len(set(names)) == len(names), "lora_modules", "names must be distinct")
        self._require(
            self.world_size == 1, "enable_lora", "needs one rank (no tensor/pipeline ranks yet)"
        )
        self._require(spec is None, "enable_lora", "cannot be combined with speculation yet")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or max(self.max_loras, len(self.lora_modules))

    @property
    def lora_paths(self) -> dict[str, str]:
        return dict(m.partition("=")[::2] for m in self.lora_modules)

    @property
    def layout(self) -> Layout:
        return Layout(self.tensor_parallel_size, self.pipeline_parallel_size)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return parse_speculative_config(self.speculative_config)

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{self.role}-{self.port}"
