"""Test-side helpers around a running stack: Generate calls, pool and worker probes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen

import grpc
from prometheus_client.parser import text_string_to_metric_families

from common.pb.tandem.internal.v1 import (
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from services.stack.launcher import Stack, StackSpec

# Small pools on the tiny llama (context 96 = 6 blocks; 12 prefill and 10 decode blocks, a
# 24-token step budget): a handful of concurrent requests forces chunked prompts and
# preemption. The `small_pools_stack` fixture (tests/conftest.py) serves these flags.
SMALL_POOLS = {
    "prefill": ["--max-model-len", "96", "--num-blocks", "12"],
    "decode": ["--max-model-len", "96", "--num-blocks", "10"],
    "scheduler": ["--max-num-batched-tokens", "24"],
}

# Short prompts of mixed scripts that the stack tests send (HF references are per prompt).
SAMPLE_PROMPTS = [
    "Once upon a time",
    "The scheduler keeps every worker busy",
    "naïve café 中文字符 🚀",
    "KV blocks move between workers",
    "In the beginning",
    "Paged attention stores keys and values",
    "Continuous batching",
    "Ελληνικά και русский",
]


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: int
    usage: generate_pb2.Usage
    messages: int


def generate(
    address: str, request: generate_pb2.GenerateRequest, timeout: float = 120.0
) -> Completion:
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        ids, text, last, count = [], [], None, 0
        for response in stub.Generate(request, timeout=timeout):
            ids.extend(response.token_ids)
            text.append(response.text)
            last, count = response, count + 1
    return Completion(ids, "".join(text), last.finish_reason, last.usage, count)


def greedy_request(prompt: str | list[int], max_tokens: int | None) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest()
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    if max_tokens is not None:
        request.max_tokens = max_tokens
    request.sampling.temperature = 0.0
    return request


def pool_stats(stack: Stack, scheduler: str | None = None) -> scheduler_pb2.GetPoolStatsResponse:
    """Every pool's counters; fails on any invariant violation the scheduler reports
    (`scheduler`: that scheduler's address; default the stack's first)."""
    with grpc.insecure_channel(scheduler or stack.spec.scheduler_address) as channel:
        stats = scheduler_pb2_grpc.SchedulerServiceStub(channel).GetPoolStats(
            scheduler_pb2.GetPoolStatsRequest(check_integrity=True), timeout=10
        )
    assert not stats.integrity_errors, list(stats.integrity_errors)
    return stats


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """Every sample at http://address/metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(
        value
        for (n, items), value in samples.items()
        if n == name and labels.items() <= dict(items).items()
    )


def worker_names(stack: Stack, *roles: str) -> list[str]:
    """The stack's workers of those roles ("prefill", "decode", "both"), by service name."""
    return [p.name for p in stack.processes if p.name.split("-")[0] in roles]


@contextmanager
def frozen(stack: Stack, names: list[str]) -> Iterator[None]:
    """The services `names` stopped (SIGSTOP) for the block and continued (SIGCONT) after
    it, also on failure. Keep it short: the scheduler fails a worker that misses several
    health checks in a row (by default 5 of up to 5 s each)."""
    try:
        for name in names:
            stack.signal(name, signal.SIGSTOP)
        yield
    finally:
        for name in names:
            stack.signal(name, signal.SIGCONT)


@contextmanager
def held_together(
    stack: Stack, n: int, timeout_s: float = 10.0, scheduler: str | None = None
) -> Iterator[None]:
    """Queue `n` requests in the scheduler before any of their prompt steps runs, whatever
    the box's load: every worker that runs prompts (prefill and both roles) is `frozen`
    while the block starts the requests (on threads: it must not wait for their results),
    and thawed once the scheduler holds all n (GetPoolStats `num_requests`: one per
    sample, one per beam search), at most `timeout_s` later (it takes well under a second
    unless the gateway compiles a grammar first: about one).

    Tests that need a preemption use it so that the preemption follows from arithmetic:
    requests queued together reach the decode pool within the few prefill steps their
    prompts take (their tokens over the step budget), so requests that each decode for
    many more steps than that, and whose KV together outgrows the pool, cannot avoid it.
    `scheduler`: that scheduler's address (default the stack's first)."""
    prompt_workers = worker_names(stack, "prefill", "both")
    assert prompt_workers, "the stack has no worker that runs prompts"
    baseline = pool_stats(stack, scheduler).num_requests
    with frozen(stack, prompt_workers):
        yield
        deadline = time.monotonic() + timeout_s
        while (held := pool_stats(stack, scheduler).num_requests - baseline) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"the scheduler holds {held} of {n} requests")
            time.sleep(0.01)


def generate_together(
    stack: Stack, requests: list[generate_pb2.GenerateRequest], timeout: float = 120.0
) -> list[Completion]:
    """`requests` (n = 1, no beam search) through the stack's gateway, each on its own
    thread, all queued in the scheduler before any prompt step runs (`held_together`);
    their completions, in order."""
    address = stack.spec.gateway_address
    with ThreadPoolExecutor(len(requests)) as pool:
        with held_together(stack, len(requests)):
            futures = [pool.submit(generate, address, r, timeout) for r in requests]
        return [f.result() for f in futures]


def worker_active_requests(stack: Stack, skip: tuple[str, ...] = ()) -> dict[str, int]:
    """Requests each worker holds in its batch (workers named in `skip` are not asked)."""
    out = {}
    for name in worker_names(stack, "prefill", "decode", "both"):
        if name in skip:
            continue
        with grpc.insecure_channel(stack.process(name).address) as channel:
            d = worker_pb2_grpc.WorkerServiceStub(channel).DescribeWorker(
                worker_pb2.DescribeWorkerRequest(), timeout=10
            )
            out[d.worker_id] = d.num_active_requests
    return out


def wait_until_idle(
    stack: Stack, timeout_s: float = 20.0, skip: tuple[str, ...] = (), scheduler: str | None = None
) -> scheduler_pb2.GetPoolStatsResponse:
    """Wait until every pool (of `scheduler`, default the stack's first) is back to
    all-free and no worker holds a request (workers named in `skip`, e.g. killed ones, are
    not asked)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = pool_stats(stack, scheduler)
        idle = stats.num_requests == 0 and all(
            p.num_free_blocks == p.num_blocks and p.num_requests == 0 for p in stats.pools
        )
        if idle and not any(worker_active_requests(stack, skip).values()):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(
                f"stack not idle after {timeout_s}s: {stats} "
                f"workers={worker_active_requests(stack, skip)}"
            )
        time.sleep(0.1)


def log_size(stack: Stack, name: str = "scheduler") -> int:
    """Bytes in service `name`'s log now: `log_lines_since` reads what comes after."""
    return (stack.run_dir / "logs" / f"{name}.log").stat().st_size


def log_lines_since(stack: Stack, offset: int, name: str = "scheduler") -> list[str]:
    """Lines service `name` logged after `offset` (a `log_size`): on a shared stack, what
    one test caused."""
    with open(stack.run_dir / "logs" / f"{name}.log", "rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace").splitlines()


@dataclass
class BackgroundStream:
    """One Generate stream read on a thread: tokens as they arrive, then how it ended."""

    address: str
    request: generate_pb2.GenerateRequest
    timeout: float = 120.0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int | None = None
    code: grpc.StatusCode | None = None  # None while running; OK when it finished
    details: str = ""
    ended_at: float | None = None

    def __post_init__(self) -> None:
        self._progress = threading.Condition()
        self._call = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            self._call = stub.Generate(self.request, timeout=self.timeout)
            try:
                for response in self._call:
                    with self._progress:
                        self.token_ids.extend(response.token_ids)
                        if response.finish_reason:
                            self.finish_reason = response.finish_reason
                        self._progress.notify_all()
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
        with self._progress:
            self.code, self.details, self.ended_at = code, details, time.monotonic()
            self._progress.notify_all()

    def wait_tokens(self, count: int, timeout_s: float = 60.0) -> None:
        """Block until `count` tokens arrived (fails if the stream ended or time ran out)."""
        with self._progress:
            if not self._progress.wait_for(
                lambda: len(self.token_ids) >= count or self.code is not None, timeout_s
            ):
                raise AssertionError(f"fewer than {count} tokens after {timeout_s}s")
        assert len(self.token_ids) >= count, (self.code, self.details, self.token_ids)

    def cancel(self) -> None:
        while self._call is None:
            time.sleep(0.01)
        self._call.cancel()

    def result(self, timeout_s: float = 120.0) -> BackgroundStream:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"stream still open after {timeout_s}s"
        return self


# The packed GEMM of test stacks' CPU workers, unless the test (or the environment) asks
# for another: Tandem's own kernel, the one `--cpu-gemm auto` keeps on this CPU class,
# without timing every format at each worker's start (~1 s of CPU per worker, serialized
# by the compute lock, over ~100 workers in the suite). `auto` itself is tested by
# tests/unit/test_gemm_plan.py, tests/service/test_compute_lock.py and the stacks started
# through the CLI (tests/service/test_stack_cli.py).
TEST_CPU_GEMM = os.environ.get("TANDEM_CPU_GEMM", "tandem")
# Test stacks fork their services (and workers their ranks) from fork servers that imported
# each service's modules once (services/stack/fork_server.py): a stack starts in ~2 s
# instead of ~7.7; TANDEM_TEST_FORK_SERVER=0 starts every process as a fresh interpreter,
# as `make up` does.
TEST_FORK_SERVER = os.environ.get("TANDEM_TEST_FORK_SERVER", "1") != "0"
# The test models' random weights would fill JSON outputs with whitespace under vLLM's
# default (any whitespace between JSON tokens): test stacks hold JSON to single spaces.
# The default itself is tested in tests/unit/test_structured_output.py.
TEST_STRUCTURED = {"TANDEM_STRUCTURED_OUTPUTS_DISABLE_ANY_WHITESPACE": "1"}


def start_stack(model, run_dir, *, ready_timeout_s: float = 180, env=None, **spec_kwargs) -> Stack:
    """A real stack (every service a process) on free ports, serving `model`; the caller
    stops it (module stacks: the `module_stacks` fixture in tests/conftest.py does).
    `env`: variables over this process's environment (and `TEST_CPU_GEMM`)."""
    spec = StackSpec.on_free_ports(str(model), **spec_kwargs)
    env = {"TANDEM_CPU_GEMM": TEST_CPU_GEMM, **TEST_STRUCTURED, **(env or {})}
    return Stack.start(
        spec, run_dir, env=env, ready_timeout_s=ready_timeout_s, exit_with_parent=True,
        fork_server=TEST_FORK_SERVER,
    )  # fmt: skip


@contextmanager
def http_front(gateway_address: str, log_path: Path, *extra: str) -> Iterator[tuple[str, Popen]]:
    """`python -m services.openai_api` (with `extra` flags) on a free port in front of a
    running gateway; ("host:port", the process) once its /health answers 200."""
    import urllib.error
    import urllib.request

    from services.stack.launcher import ROOT
    from services.stack.ports import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_EXIT_WITH_PARENT": "1"}
    argv = [sys.executable, "-m", "services.openai_api", "--host", "127.0.0.1",
            "--port", str(port), "--gateway", gateway_address, *extra]  # fmt: skip
    with open(log_path, "wb") as log:
        process = Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://{address}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                pass
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the HTTP front did not start"
            time.sleep(0.1)
        yield address, process
    finally:
        stop_process(process)


def stop_process(process: Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; returns once the process is reaped."""
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
