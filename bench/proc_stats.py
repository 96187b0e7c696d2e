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


@dataclass(frozen=True)
class HostSample:
    """The whole machine's CPU time (`/proc/stat`, every core summed), in seconds."""

    busy_s: float  # user, nice, system, irq, softirq
    idle_s: float  # idle and iowait
    steal_s: float  # taken by the hypervisor for other guests

    def __sub__(self, other: HostSample) -> HostSample:
        return HostSample(
            self.busy_s - other.busy_s, self.idle_s - other.idle_s, self.steal_s - other.steal_s
        )


def host_sample() -> HostSample:
    text = _read("/proc/stat") or "cpu 0 0 0 0 0 0 0 0"
    fields = [int(v) / CLOCK_TICKS for v in text.splitlines()[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return HostSample(user + nice + system + irq + softirq, idle + iowait, steal)


def thread_samples(pid: int) -> dict[int, tuple[str, CpuSample]]:
    """Per thread of `pid`: (its name, its CPU sample)."""
    out: dict[int, tuple[str, CpuSample]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        stat = _read(f"/proc/{pid}/task/{tid}/stat")
        sched = _read(f"/proc/{pid}/task/{tid}/schedstat")
        if stat is None or sched is None:
            continue
        name = stat.split("(", 1)[1].rsplit(")", 1)[0]
        fields = stat.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        out[int(tid)] = (name, CpuSample(cpu, int(sched.split()[1]) / 1e9))
    return out
