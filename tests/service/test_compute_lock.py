"""The host's compute lock: workers in different processes take turns, a dead holder
releases it, and a frozen holder delays others by at most `max_wait_s`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.worker.compute_lock import ComputeLock, default_lock_path, make_compute_lock

ROOT = Path(__file__).resolve().parents[2]

# A process that takes the lock `rounds` times, recording when it held it.
_TAKE_TURNS = """
import json, sys, time
from services.worker.compute_lock import ComputeLock
lock = ComputeLock(sys.argv[1])
spans = []
def hold():
    start = time.monotonic()
    time.sleep(0.01)
    spans.append((start, time.monotonic()))
for _ in range(int(sys.argv[2])):
    lock.run(hold)
print(json.dumps(spans))
"""

# A process that takes the lock and keeps it until killed.
_HOLD_FOREVER = """
import sys, time
from services.worker.compute_lock import ComputeLock
ComputeLock(sys.argv[1]).run(lambda: (print("holding", flush=True), time.sleep(3600)))
"""


def _python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True, **kwargs)


def test_processes_never_hold_it_at_once(tmp_path):
    path = str(tmp_path / "compute.lock")
    procs = [_python(_TAKE_TURNS, path, "25", stdout=subprocess.PIPE) for _ in range(3)]
    spans = sorted(span for p in procs for span in json.loads(p.communicate(timeout=60)[0]))
    assert len(spans) == 75
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert start >= end, "two processes held the compute lock at the same time"


def test_a_killed_holder_releases_it_and_a_frozen_one_is_bounded(tmp_path):
    path = str(tmp_path / "compute.lock")
    holder = _python(_HOLD_FOREVER, path, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "holding"
        os.kill(holder.pid, signal.SIGSTOP)  # frozen while holding it
        lock = ComputeLock(path, max_wait_s=0.3)
        started = time.monotonic()
        assert lock.run(lambda: 42) == 42  # ran anyway, after the bound
        assert time.monotonic() - started >= 0.3 and lock.num_timeouts == 1
        holder.kill()
        holder.wait(timeout=10)
        assert lock.run(lambda: 7) == 7
        assert lock.num_timeouts == 1  # acquired normally once the holder died
    finally:
        holder.kill()


def test_settings():
    assert make_compute_lock("off", "cpu") is None
    assert make_compute_lock("auto", "cuda") is None
    lock = make_compute_lock("auto", "cpu")
    assert lock is not None and lock.path == default_lock_path()
    lock.close()
    with pytest.raises(ValueError, match="max_wait_s"):
        ComputeLock(default_lock_path(), max_wait_s=0)


# A process that takes the lock back to back (like a decode worker's queued steps) until
# killed, holding it 5 ms each time.
_BACK_TO_BACK = """
import sys, time
from services.worker.compute_lock import ComputeLock
lock = ComputeLock(sys.argv[1])
lock.run(lambda: print("started", flush=True))
while True:
    lock.run(time.sleep, 0.005)
"""


def test_a_waiting_process_gets_the_next_turn_from_a_back_to_back_holder(tmp_path):
    """flock has no queue: without the `.want` hand-off a waiter only got in when the
    holder happened to pause (often only at `max_wait_s`); now it waits for one turn."""
    path = str(tmp_path / "compute.lock")
    holder = _python(_BACK_TO_BACK, path, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "started"
        lock = ComputeLock(path, max_wait_s=2.0)
        waits = []
        for _ in range(10):
            time.sleep(0.03)  # the holder is back to its back-to-back turns
            started = time.monotonic()
            lock.run(lambda: None)
            waits.append(time.monotonic() - started)
        assert lock.num_timeouts == 0
        assert sorted(waits)[len(waits) // 2] < 0.1, waits
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_waiting_for_the_lock_uses_no_cpu(tmp_path):
    """A waiting worker blocks in flock (on a helper thread) instead of polling: polling
    took ~10% of a core from the worker that was computing."""
    path = str(tmp_path / "compute.lock")
    holder = _python(_HOLD_FOREVER, path, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "holding"
        lock = ComputeLock(path, max_wait_s=1.0)
        cpu_before = time.process_time()
        assert lock.run(lambda: 1) == 1 and lock.num_timeouts == 1  # waited the full second
        assert time.process_time() - cpu_before < 0.02
        holder.kill()
        holder.wait(timeout=10)
        assert lock.run(lambda: 2) == 2 and lock.num_timeouts == 1  # the helper's late grant
        lock.close()
    finally:
        holder.kill()


def test_a_worker_measures_and_packs_its_weights_only_in_its_turn(tmp_path, tiny_llama_dir):
    """`cpu_gemm auto` times the products at load; a worker does it holding the host's lock,
    so a neighbour computing (or measuring) does not skew it, and waits longer for it than a
    step would (a neighbour's measurement takes seconds)."""
    import threading

    import torch

    from services.worker.config import WorkerConfig
    from services.worker.models.gemm_plan import MEASURED_ROWS
    from services.worker.models.weight_loader import load_model
    from services.worker.startup import MEASURE_WAIT_S, pack_taking_turns

    assert MEASURE_WAIT_S > 2.0
    path = str(tmp_path / "compute.lock")
    model, _ = load_model(tiny_llama_dir, torch.float32)
    config = WorkerConfig(model=str(tiny_llama_dir), cpu_compute_lock=path, cpu_gemm="auto")
    holder = _python(_HOLD_FOREVER, path, stdout=subprocess.PIPE)
    result = []
    try:
        assert holder.stdout.readline().strip() == "holding"
        packing = threading.Thread(
            target=lambda: result.append(pack_taking_turns(config, model, torch.device("cpu")))
        )
        packing.start()
        packing.join(timeout=3.0)  # past a step's 2 s bound: still waiting its turn
        assert packing.is_alive() and not result
        holder.kill()
        packing.join(timeout=60)
        assert not packing.is_alive()
    finally:
        holder.kill()
    packed_bytes, plan = result[0]
    # measured, once the lock was free: every row count, plain and each packed format
    assert plan.timings_us is not None and set(plan.timings_us["plain"]) == set(MEASURED_ROWS)
    assert (packed_bytes > 0) == (plan.packed_format is not None)
