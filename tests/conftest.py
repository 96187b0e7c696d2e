"""Session-wide pytest fixtures shared by the test suite."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Triton kernels run on CPU only in the interpreter, which must be chosen before any kernel
# is defined; GPU machines compile them for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from devtools.checkpoint_builder import build_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random llama checkpoint, sharded (with an index) so sharded loading is exercised."""
    return build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", max_shard_size="100KB"
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random qwen2 checkpoint (q/k/v biases), single safetensors file."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2", "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random qwen3 checkpoint (per-head q/k RMSNorm), single safetensors file."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3", "qwen3")


@pytest.fixture(scope="session")
def api_stack(tiny_llama_dir, tmp_path_factory):
    """One disaggregated stack (prefill + decode worker) on the tiny llama, shared by the
    generation-API test modules."""
    from services.stack.launcher import Stack, StackSpec

    spec = StackSpec.on_free_ports(str(tiny_llama_dir))
    stack = Stack.start(
        spec, tmp_path_factory.mktemp("api-stack"), ready_timeout_s=180, exit_with_parent=True
    )
    yield stack
    stack.stop()
