"""The KV pool in shared memory (the owner's `SharedPool`, a same-host peer's `PeerPool`).

A CPU worker's pool lives in a memfd: a 4 KiB header, then the pool tensor (the layout of
`kv_cache`). A peer on the same host opens it as `/proc/<pid>/fd/<fd>`, checks the random
token at its start and maps it; an owner killed meanwhile cannot hurt it: the mapping
keeps the memory alive, and the owner's exit shows on a pidfd.

The header carries the owner's progress, written on its tensor thread: the step it runs
and how many layers of that step have written their KV (`progress = step * LAYER_SLOTS +
layers`), and, for its last 16 steps, when each finished its last layer (CLOCK_MONOTONIC
is one clock for every process on the host). Layer `l` of a block is final once the owner
reports layer `l` done for the step that writes the block's last tokens.
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
import select
import time
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from common.kv_shared_memory import HEADER_BYTES, SharedMemoryInfo

TOKEN_BYTES = 16
LAYER_SLOTS = 1 << 12  # layers per step in the progress word (a model has fewer)
RING = 16  # recent steps whose last layer's end time the header keeps
_PROGRESS = 0  # int64 words after the token: progress, then RING x (step, last layer ns)
_WORDS = 1 + 2 * RING


def host_id() -> str:
    """Equal for two processes that may pull each other's KV out of shared memory: the
    boot id, the PID namespace (the memfd is opened by /proc path) and the network
    namespace (two pods of one node, or two "hosts" of `services/stack/hosts.py`, move KV
    over UCX, the path a real network takes)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    pid_ns, net_ns = (os.stat(f"/proc/self/ns/{kind}").st_ino for kind in ("pid", "net"))
    return f"{boot}:{pid_ns}:{net_ns}"


class SharedPool:
    """The owner's side: the memfd, the pool bytes in it, and the progress header."""

    def __init__(self, pool_bytes: int, num_layers: int) -> None:
        if pool_bytes <= 0 or not 0 < num_layers < LAYER_SLOTS:
            raise ValueError(f"bad shared pool: {pool_bytes} bytes, {num_layers} layers")
        self.num_layers = num_layers
        num_bytes = HEADER_BYTES + pool_bytes
        self.fd = os.memfd_create("tandem-kv-pool", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, num_bytes)
        # Every page is allocated now (as torch.zeros would): no faults while serving.
        self._map = mmap.mmap(self.fd, num_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        token = secrets.token_bytes(TOKEN_BYTES)
        self._map[:TOKEN_BYTES] = token
        self._words = np.frombuffer(self._map, dtype=np.int64, count=_WORDS, offset=TOKEN_BYTES)
        self.pool = torch.frombuffer(self._map, dtype=torch.uint8, offset=HEADER_BYTES)
        self.info = SharedMemoryInfo(host_id(), os.getpid(), self.fd, num_bytes, token)
        self._stamped = 0  # the last step whose last layer's time is in the ring

    def step_started(self, step_id: int) -> None:
        self._words[_PROGRESS] = step_id * LAYER_SLOTS

    def layer_done(self, step_id: int, layer: int) -> None:
        if layer + 1 == self.num_layers:
            self._stamp(step_id)
        self._words[_PROGRESS] = step_id * LAYER_SLOTS + layer + 1

    def step_done(self, step_id: int) -> None:
        """The step ended (a step with no forward pass reports no layer)."""
        if self._stamped != step_id:
            self._stamp(step_id)
        self._words[_PROGRESS] = step_id * LAYER_SLOTS + self.num_layers

    def _stamp(self, step_id: int) -> None:
        slot = 1 + 2 * (step_id % RING)
        self._words[slot + 1] = time.monotonic_ns()
        self._words[slot] = step_id
        self._stamped = step_id

    def reset(self) -> None:
        """Step ids start over (a new scheduler)."""
        self._words[:] = 0
        self._stamped = 0


class PeerPool:
    """A same-host peer's pool, mapped read-only, and its liveness. `writable`: mapped for
    writing too, which only rank 0 of a tensor-parallel worker does, into the pools of its
    own other ranks (the KV heads they hold, received for them)."""

    def __init__(
        self,
        info: SharedMemoryInfo,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        writable: bool = False,
    ):
        """`block_shape`: one block's shape in the peer's pool."""
        self.pidfd = os.pidfd_open(info.pid)  # first: the token check below pins the process
        try:
            fd = os.open(f"/proc/{info.pid}/fd/{info.fd}", os.O_RDWR if writable else os.O_RDONLY)
            try:
                if os.fstat(fd).st_size != info.num_bytes:
                    raise ValueError("the peer's shared pool has another size than described")
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                self._map = mmap.mmap(fd, info.num_bytes, mmap.MAP_SHARED | mmap.MAP_POPULATE, prot)
            finally:
                os.close(fd)
            if self._map[:TOKEN_BYTES] != info.token:
                raise ValueError("the peer's shared pool has another token than described")
        except BaseException:
            os.close(self.pidfd)
            raise
        self._words = np.frombuffer(self._map, dtype=np.int64, count=_WORDS, offset=TOKEN_BYTES)
        with warnings.catch_warnings():  # read-only on purpose: this side never writes
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._map, dtype=torch.uint8, offset=info.pool_offset)
        block_bytes = math.prod(block_shape) * dtype.itemsize
        if flat.numel() % block_bytes:
            raise ValueError("the peer's shared pool is not a whole number of blocks")
        self.data = flat.view(dtype).view(flat.numel() // block_bytes, *block_shape)

    def progress(self) -> int:
        """The raw progress word (`step * LAYER_SLOTS + layers`)."""
        return int(self._words[_PROGRESS])

    def layers_ready(self, step_id: int, num_layers: int) -> int:
        """Layers whose KV is final for blocks that step `step_id` completes (0 = now)."""
        step, layers = divmod(self.progress(), LAYER_SLOTS)
        if step_id == 0 or step > step_id:
            return num_layers
        return layers if step == step_id else 0

    def done_ns(self, step_id: int) -> int | None:
        """When step `step_id` finished its last layer (monotonic ns), if it is one of the
        peer's last 16 steps (its step id is read first: it is written last)."""
        slot = 1 + 2 * (step_id % RING)
        return int(self._words[slot + 1]) if int(self._words[slot]) == step_id else None

    def alive(self) -> bool:
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return not poller.poll(0)  # a pidfd turns readable when its process exits

    def close(self) -> None:
        """Let go of the mapping: it is unmapped once no tensor views it (never before: a
        copy still queued with a view keeps it)."""
        self.data = self._words = self._map = None
        os.close(self.pidfd)
