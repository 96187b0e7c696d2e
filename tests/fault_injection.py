"""Fault injection on a real stack: which services run, whether they still do, waiting for
the pools to be whole again, and killing the worker that holds the most requests (frozen
first, so "mid-request" is certain). Shared by the fault tests."""

from __future__ import annotations

import signal
import time

from common.healthcheck import health_status
from services.stack.launcher import Stack
from tests.stack_client import pool_stats


def names(stack: Stack, role: str) -> list[str]:
    return [p.name for p in stack.processes if p.name.startswith(f"{role}-")]


def pools_by_name(stack: Stack) -> dict[str, object]:
    return {p.worker_id: p for p in pool_stats(stack).pools}


def assert_all_alive(stack: Stack) -> None:
    dead = [p.name for p in stack.processes if not stack.alive(p)]
    assert not dead, f"processes exited: {dead}"


def assert_all_alive_but(stack: Stack, killed: str) -> None:
    dead = [p.name for p in stack.processes if not stack.alive(p)]
    assert dead == [killed], f"exited: {dead}, expected only {killed}"


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"{what} not true after {timeout_s}s")


def wait_healthy_pools(stack: Stack, timeout_s: float = 30.0) -> None:
    """Every worker is back in the scheduler's pools and the scheduler serves."""
    wait_for(
        lambda: (
            all(p.healthy and not p.draining for p in pool_stats(stack).pools)
            and health_status(stack.spec.scheduler_address) == "SERVING"
        ),
        timeout_s,
        "every pool healthy",
    )


def kill_busiest(stack: Stack, role: str) -> str:
    """Freeze every worker of `role`, SIGKILL the one holding most requests, thaw the
    rest; returns the killed one's name. The freeze makes 'mid-request' certain."""
    workers = names(stack, role)
    for name in workers:
        stack.signal(name, signal.SIGSTOP)
    try:
        pools = pools_by_name(stack)
        victim = max(workers, key=lambda n: pools[n].num_requests)
        assert pools[victim].num_requests > 0, "no request in flight on any worker"
        stack.signal(victim, signal.SIGKILL)
    finally:
        for name in workers:
            stack.signal(name, signal.SIGCONT)
    stack.wait_exit(victim)
    return victim
