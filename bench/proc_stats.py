"""CPU accounting of running processes from /proc: CPU time used and time spent runnable
but waiting for a core (the scheduler's run-queue delay, `/proc/<pid>/task/*/schedstat`),
summed over every thread. Linux only; a process or thread that is gone counts as zero."""

from __future__ import annotations

import os
from dataclasses import dataclass

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuSample:
    cpu_s: float  # user + system time of every thread
    wait_s: float  # time runnable but not running (waiting for a core)

    def __sub__(self, other: CpuSample) -> CpuSample:
        return CpuSample(self.cpu_s - other.cpu_s, self.wait_s - other.wait_s)


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None


def cpu_sample(pid: int) -> CpuSample:
    cpu = wait = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return CpuSample(0.0, 0.0)
    for tid in tids:
        stat = _read(f"/proc/{pid}/task/{tid}/stat")
        if stat is not None:
            fields = stat.rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        sched = _read(f"/proc/{pid}/task/{tid}/schedstat")
        if sched is not None:
            wait += int(sched.split()[1]) / 1e9
    return CpuSample(cpu, wait)


def tree_pids(pid: int) -> list[int]:
    """`pid` and all its descendants (a client that runs subprocesses)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _read(f"/proc/{entry}/stat")
        if stat is None:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def tree_sample(pid: int) -> CpuSample:
    total = CpuSample(0.0, 0.0)
    for member in tree_pids(pid):
        sample = cpu_sample(member)
        total = CpuSample(total.cpu_s + sample.cpu_s, total.wait_s + sample.wait_s)
    return total
