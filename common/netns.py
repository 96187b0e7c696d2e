"""Entering a network namespace made with `ip netns add` (the multi-host test bed,
`services/stack/hosts.py`): what `ip netns exec` does for the network, for a process
forked from a fork server instead of started through `ip`."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"


def enter_netns(name: str) -> None:
    """Move this (single-threaded, freshly forked) process into namespace `name`."""
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name!r}: {os.strerror(errno)}")
    finally:
        os.close(fd)
