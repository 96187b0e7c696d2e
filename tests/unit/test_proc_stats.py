"""CPU accounting from /proc (`bench/proc_stats.py`), as `bench.profile_serve` reads it: a
thread that burns CPU shows it under its own id (an exited thread is gone), the process sums
its live threads, and the host's busy time grows by at least what both burners used."""

from __future__ import annotations

import os
import threading
import time

from bench.proc_stats import cpu_sample, host_sample, thread_samples


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(1000))


def test_a_busy_thread_shows_its_cpu_in_the_thread_process_and_host_samples():
    pid = os.getpid()
    host_before, process_before = host_sample(), cpu_sample(pid)
    threads_before = thread_samples(pid)
    worker = threading.Thread(target=_burn, args=(0.4,))
    worker.start()
    tid = worker.native_id
    worker.join()
    # A thread that has exited is gone from /proc: measure one that is still alive.
    done = threading.Event()
    alive = threading.Thread(target=lambda: (_burn(0.4), done.wait()))
    alive.start()
    time.sleep(0.5)
    after = thread_samples(pid)
    name, sample = after[alive.native_id]
    assert sample.cpu_s >= 0.25, sample
    assert alive.native_id not in threads_before and tid not in after
    assert name  # the thread's name from /proc (python, or what the thread set)
    process = cpu_sample(pid) - process_before
    host = host_sample() - host_before
    done.set()
    alive.join()
    # Summed over the threads alive now (the exited burner's time left with it).
    assert process.cpu_s >= 0.25
    assert host.busy_s >= 0.6
