"""A stack over several hosts of the namespace test bed (`hosts.py`): which service runs
on which host, and the spec that starts each one there.

By default the gateway (and the HTTP front) stand on host 0, each scheduler on a host of
its own, and the workers spread over the remaining hosts in turn; with as many hosts as
services plus one, every service has its own. Tests place services explicitly (two decode
workers on one host, say, to show that the same-host pull is still taken there).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

from services.stack.commands import service_commands
from services.stack.hosts import Fabric
from services.stack.launcher import StackSpec

FRONT = ("gateway", "http")


def default_placement(names: Sequence[str], num_hosts: int) -> dict[str, int]:
    """Service name -> host index: the front on host 0, then schedulers, then workers,
    each on the next host in turn (over hosts 1..N-1; all on host 0 with one host)."""
    if num_hosts < 1:
        raise ValueError(f"--hosts must be >= 1, got {num_hosts}")
    rest = itertools.cycle(range(1, num_hosts) if num_hosts > 1 else [0])
    schedulers = [n for n in names if n.startswith("scheduler")]
    workers = [n for n in names if n not in FRONT and n not in schedulers]
    out = {n: 0 for n in names if n in FRONT}
    for name in [*schedulers, *workers]:
        out[name] = next(rest)
    return out


def place(spec: StackSpec, fabric: Fabric, placement: Mapping[str, int] | None = None) -> StackSpec:
    """`spec` with every service on its host of `fabric` (`placement`: name -> host index;
    default `default_placement`)."""
    names = [name for name, _, _ in service_commands(spec)]
    chosen = (
        dict(placement) if placement is not None else default_placement(names, len(fabric.hosts))
    )
    unknown = sorted(set(chosen) - set(names))
    missing = sorted(set(names) - set(chosen))
    if unknown or missing:
        raise ValueError(f"placement names no such service {unknown} / leaves out {missing}")
    hosts = {}
    for name, index in chosen.items():
        if not 0 <= index < len(fabric.hosts):
            raise ValueError(f"{name} placed on host {index}; the fabric has {len(fabric.hosts)}")
        host = fabric.hosts[index]
        hosts[name] = (host.netns, host.address)
    return dataclasses.replace(spec, hosts=hosts)


def host_of(spec: StackSpec, fabric: Fabric, name: str) -> int:
    """The index of the host service `name` runs on."""
    netns = spec.netns_of(name)
    for host in fabric.hosts:
        if host.netns == netns:
            return host.index
    raise KeyError(f"{name} runs on no host of this fabric")


def worker_names(spec: StackSpec, role: str) -> list[str]:
    ports: Sequence[int] = {"prefill": spec.prefill_ports, "decode": spec.decode_ports,
                            "both": spec.both_ports}[role]  # fmt: skip
    return [f"{role}-{port}" for port in ports]
