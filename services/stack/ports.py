"""Free TCP ports for the services of a stack started on free ports (tests, benchmarks).

A port is handed out some time before its service binds it. A port the kernel picked
(`bind` to port 0) lies in its ephemeral range, the same range every outgoing connection
takes its local port from: in between, a client's connection (a health check, a UCX
endpoint, pip) could take it, and the service then fails to bind ("Failed to bind to
address 127.0.0.1:35859", seen once in a full test run). So ports come from below that
range, chosen at random, checked free by binding them, and never handed out twice by one
process. Where no such port is found, the kernel's choice is the fallback.
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST = 20000  # the ports below the ephemeral range that are drawn from
TRIES = 200

_handed: set[int] = set()
_draw = random.Random()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (Linux's default when unreadable)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, below the kernel's ephemeral range, not handed out before here."""
    low, _ = ephemeral_range()
    if low - LOWEST >= 1000:
        for _ in range(TRIES):
            port = _draw.randrange(LOWEST, low)
            if port not in _handed and _bindable(host, port):
                _handed.add(port)
                return port
    with socket.socket() as sock:  # fallback: the kernel's choice
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    _handed.add(port)
    return port
