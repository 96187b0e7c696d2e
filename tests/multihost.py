"""A stack spread over hosts of the namespace test bed (`services/stack/hosts.py`), for the
multi-host tests: each service on the host a test places it, and what a test needs to
watch a fault (events in a service's log, a worker's transfer counters).

Tests that need namespaces skip, with `hosts.unavailable()`'s reason, where they cannot be
made (not root, no `ip`); CI runs as root and makes them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from services.stack.hosts import Fabric, unavailable
from services.stack.launcher import Stack, StackSpec
from services.stack.multihost import place
from tests.stack_client import (
    TEST_CPU_GEMM,
    TEST_FORK_SERVER,
    TEST_STRUCTURED,
    log_lines_since,
    log_size,
    scrape,
    total,
)


def need_namespaces() -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)


def start_on_hosts(
    model: Path,
    run_dir: Path,
    fabric: Fabric,
    placement: Mapping[str, int] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 180,
    **spec_kwargs,
) -> Stack:
    """A stack on free ports whose services run on `fabric`'s hosts (`placement`: service
    name -> host, with the names `service_commands` gives; a callable of the spec may
    compute it). Metrics ports are on, so transfer counters can be read."""
    spec = StackSpec.on_free_ports(str(model), metrics=True, **spec_kwargs)
    if callable(placement):
        placement = placement(spec)
    spec = place(spec, fabric, placement)
    env = {"TANDEM_CPU_GEMM": TEST_CPU_GEMM, **TEST_STRUCTURED, **(env or {})}
    return Stack.start(spec, run_dir, env=env, ready_timeout_s=ready_timeout_s,
                       exit_with_parent=True, fork_server=TEST_FORK_SERVER)  # fmt: skip


def events_since(stack: Stack, offset: int, event: str, name: str = "scheduler") -> list[dict]:
    """The JSON log records of `event` that service `name` wrote after `offset`."""
    out = []
    for line in log_lines_since(stack, offset, name):
        if f'"{event}"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            out.append(record)
    return out


def wait_event(
    stack: Stack, offset: int, event: str, name: str = "scheduler", timeout_s: float = 60.0, **match
) -> tuple[dict, float]:
    """Wait for `event` (with fields equal to `match`) in service `name`'s log after
    `offset`; returns the record and when it was seen (time.monotonic())."""
    deadline = time.monotonic() + timeout_s
    while True:
        for record in events_since(stack, offset, event, name):
            if all(record.get(k) == v for k, v in match.items()):
                return record, time.monotonic()
        if time.monotonic() > deadline:
            raise AssertionError(f"no {event} {match} in {name}'s log after {timeout_s}s")
        time.sleep(0.05)


def kv_bytes(stack: Stack, worker: str, direction: str) -> float:
    """KV bytes the worker moved in `direction` ('send', 'receive' over UCX, 'pull' out
    of a same-host peer's shared pool)."""
    samples = scrape(stack.process(worker).metrics)
    return total(samples, "tandem:kv_transfer_bytes_total", direction=direction)


def ucx_held_bytes(stack: Stack, worker: str) -> float:
    """Bytes of given-up UCX sends/receives the worker's UCX still holds."""
    return total(scrape(stack.process(worker).metrics), "tandem:kv_transfer_abandoned_bytes")


def offsets(stack: Stack) -> dict[str, int]:
    """Every service's log size now (events after this point belong to the caller)."""
    return {p.name: log_size(stack, p.name) for p in stack.processes}
