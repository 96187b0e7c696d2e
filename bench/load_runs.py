"""One stack, several closed-loop loads in a row: warm up, then for each (concurrency,
requests) run the client, snapshot a pool's stats before and after, and keep a row of
numbers. Shared by the benches that compare two settings of one stack shape
(`bench.spec_decode`, `bench.tensor_parallel`)."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
from transformers import AutoTokenizer

from bench.metrics import RequestRecord, summarize
from bench.report import load_average
from bench.serve_client import run_client, warm_up
from bench.workloads import usable_token_ids
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.stack.launcher import Stack, StackSpec

# (records, summary, pool stats before, pool stats after) -> the load's extra numbers
RowFn = Callable[[list[RequestRecord], dict, object, object], dict]


@contextmanager
def bench_stack(model: Path, extra_args: dict, prefix: str, **shape) -> Iterator[Stack]:
    """A stack on free ports (default shape: 1 prefill + 1 decode worker; `shape` as
    `StackSpec.on_free_ports` takes it) with these flags, stopped on the way out."""
    spec = StackSpec.on_free_ports(str(model), extra_args=extra_args, **shape)
    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    stack = Stack.start(spec, run_dir, ready_timeout_s=300, exit_with_parent=True)
    try:
        yield stack
    finally:
        stack.stop()


def pool_stats(scheduler: str, role: int | None = None):
    """The stats of the scheduler's one pool, or of its first pool of `role`."""
    with grpc.insecure_channel(scheduler) as channel:
        stats = scheduler_pb2_grpc.SchedulerServiceStub(channel).GetPoolStats(
            scheduler_pb2.GetPoolStatsRequest(), timeout=10
        )
    if role is None:
        (only,) = stats.pools
        return only
    return next(p for p in stats.pools if p.role == role)


def run_loads(
    gateway: str,
    model: Path,
    loads: Sequence[tuple[int, int]],
    requests_by_load: Sequence,
    label: str,
    stats: Callable[[], object],
    row: RowFn,
    sampling: str = "greedy",
) -> dict[str, dict]:
    """{"c<concurrency>": {tok/s, TPOT, TTFT, completed, load average, **row(...)}}."""
    warm_up(gateway, usable_token_ids(AutoTokenizer.from_pretrained(model)))
    out = {}
    for (concurrency, _), requests in zip(loads, requests_by_load, strict=True):
        before = stats()
        load = load_average()
        records, wall = run_client(
            gateway,
            requests,
            None,
            concurrency,
            f"bench-{uuid.uuid4().hex}",
            label=f"{label} c{concurrency}",
            show_progress=False,
            sampling=sampling,
        )
        after = stats()
        summary = summarize(records, wall)
        out[f"c{concurrency}"] = {
            "output_tokens_per_s": summary["output_tokens_per_s"],
            "tpot_ms": summary["tpot_ms"],
            "ttft_ms": summary["ttft_ms"],
            "completed": summary["completed"],
            **row(records, summary, before, after),
            "load_avg_1m_before": load,
        }
    return out
