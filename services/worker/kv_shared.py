"""The KV pool in shared memory, and copying blocks out of a same-host peer's pool.

A CPU worker's pool lives in a memfd: a 4 KiB header, then the pool tensor (the layout of
`kv_cache`). A peer on the same host (same boot, same PID namespace) opens it as
`/proc/<pid>/fd/<fd>`, checks the random token at its start, maps it read-only, and
copies the blocks it needs straight from the owner's pool into its own: one copy, no
staging buffer on either side, no message. The receiver does every write into its own
pool (on its tensor thread, ordered with its steps), so cancelling a transfer needs no
help from the owner; and an owner killed mid-transfer cannot hurt the receiver: its
mapping keeps the memory alive, and the owner's exit shows on a pidfd.

The header carries the owner's progress, written on its tensor thread: the step it runs
and how many layers of that step have written their KV (`progress = step * LAYER_SLOTS +
layers`), and, for its last 16 steps, when each finished its last layer (CLOCK_MONOTONIC
is one clock for every process on the host). A receiver streams a prompt's KV layer by layer
while the owner still computes it: layer `l` of a block is final once the owner reports
layer `l` done for the step that writes the block's last tokens.
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
from services.worker.kv_cache import block_runs  # noqa: F401  (re-exported: its users)

TOKEN_BYTES = 16
LAYER_SLOTS = 1 << 12  # layers per step in the progress word (a model has fewer)
RING = 16  # recent steps whose last layer's end time the header keeps
_PROGRESS = 0  # int64 words after the token: progress, then RING x (step, last layer ns)
_WORDS = 1 + 2 * RING


def host_id() -> str:
    """Equal for two processes that may pull each other's KV out of shared memory: the
    host's boot id, the PID namespace (the memfd is opened by /proc path) and the network
    namespace. Two pods of one node, or two "hosts" of the namespace test bed
    (`services/stack/hosts.py`), are different hosts: KV between them goes over UCX, the
    path a real network takes, never the same-host pull."""
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
        self.num_bytes = HEADER_BYTES + pool_bytes
        self.fd = os.memfd_create("tandem-kv-pool", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.num_bytes)
        # Every page is allocated now (as torch.zeros would): no faults while serving.
        self._map = mmap.mmap(self.fd, self.num_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._map[:TOKEN_BYTES] = self.token
        self._words = np.frombuffer(self._map, dtype=np.int64, count=_WORDS, offset=TOKEN_BYTES)
        self.pool = torch.frombuffer(self._map, dtype=torch.uint8, offset=HEADER_BYTES)
        self.info = SharedMemoryInfo(host_id(), os.getpid(), self.fd, self.num_bytes, self.token)
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
        self.info = info
        self.pidfd = os.pidfd_open(info.pid)  # first: the token check below pins the process
        try:
            fd = os.open(f"/proc/{info.pid}/fd/{info.fd}", os.O_RDWR if writable else os.O_RDONLY)
            try:
                if os.fstat(fd).st_size != info.num_bytes:
                    raise ValueError("the peer's shared pool has another size than described")
                self._map = mmap.mmap(
                    fd,
                    info.num_bytes,
                    flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                    prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0),
                )
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
        block_bytes = math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()
        if flat.numel() % block_bytes:
            raise ValueError("the peer's shared pool is not a whole number of blocks")
        self.data = flat.view(dtype).view(flat.numel() // block_bytes, *block_shape)
        self.num_blocks = self.data.shape[0]

    def progress(self) -> int:
        """The raw progress word (`step * LAYER_SLOTS + layers`)."""
        return int(self._words[_PROGRESS])

    def layers_ready(self, step_id: int, num_layers: int) -> int:
        """Layers whose KV is final for blocks that step `step_id` completes (0 = now)."""
        if step_id == 0:
            return num_layers
        step, layers = divmod(int(self._words[_PROGRESS]), LAYER_SLOTS)
        if step > step_id:
            return num_layers
        return layers if step == step_id else 0

    def done_ns(self, step_id: int) -> int | None:
        """When step `step_id` finished its last layer (monotonic ns), if it is one of the
        peer's last 16 steps."""
        slot = 1 + 2 * (step_id % RING)
        done_ns = int(self._words[slot + 1])
        return done_ns if int(self._words[slot]) == step_id else None

    def alive(self) -> bool:
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return not poller.poll(0)  # a pidfd turns readable when its process exits

    def close(self) -> None:
        """Let go of the mapping: it is unmapped once no tensor views it (never before: a
        copy still queued with a view keeps it)."""
        self.data = self._words = self._map = None
        os.close(self.pidfd)


def copy_layers(
    dst: torch.Tensor,
    src: torch.Tensor,
    runs: Sequence[tuple[int, int, int]],
    first_layer: int,
    end_layer: int,
) -> None:
    """dst[d + i, layers] = src[s + i, layers] for every run: one strided copy per run
    (block-major pools: a block's layers are contiguous)."""
    for s, d, n in runs:
        dst[d : d + n, first_layer:end_layer].copy_(src[s : s + n, first_layer:end_layer])


def copy_head_slice(
    dst: torch.Tensor,
    src: torch.Tensor,
    runs: Sequence[tuple[int, int, int]],
    layers: tuple[range, range],
    heads: tuple[range, range],
) -> None:
    """Between pools of differently sharded workers (`common.parallel_plan.KvSlice`): for
    every run, the (src, dst) `layers` and KV `heads` of the source blocks into the same
    layers and heads of the destination blocks, one strided copy per run. Pools are
    `[blocks, layers, 2, slot, heads, dim]`; layer and head indices are each pool's own."""
    (src_layers, dst_layers), (src_heads, dst_heads) = layers, heads
    if len(src_layers) != len(dst_layers) or len(src_heads) != len(dst_heads):
        raise ValueError(f"slice shapes differ: {layers} {heads}")
    sl = slice(src_layers.start, src_layers.stop)
    dl = slice(dst_layers.start, dst_layers.stop)
    sh = slice(src_heads.start, src_heads.stop)
    dh = slice(dst_heads.start, dst_heads.stop)
    for s, d, n in runs:
        dst[d : d + n, dl, :, :, dh].copy_(src[s : s + n, sl, :, :, sh])
