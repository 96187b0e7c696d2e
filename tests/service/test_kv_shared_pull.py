"""KV pulled straight out of a same-host peer's shared pool (kv_shared, kv_pull), with a
real owner process: bit-identical blocks, layer-by-layer streaming, a cancelled pull, KV
that outlives its owner, and an owner SIGKILLed mid-stream 50 times in a row."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from common.kv_shared_memory import SharedMemoryInfo
from services.worker.kv_cache import KvCache
from services.worker.kv_pull import KvPuller, KvSource
from services.worker.kv_shared import SharedPool
from services.worker.kv_transfer import KvTransferCancelled, KvTransferError

GEOMETRY = dict(block_size=4, num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
OWNER_BLOCKS = 24
STEP = 7


def owner(conn) -> None:
    """A peer worker: its pool in shared memory, filled with a known pattern; reports
    progress on command ("layer N", "done"), then waits to be told to exit (or killed)."""
    pool = SharedPool(OWNER_BLOCKS * KvCache.bytes_per_block(**GEOMETRY), GEOMETRY["num_layers"])
    pattern = np.random.default_rng(0).integers(0, 255, pool.pool.numel(), dtype=np.uint8)
    pool.pool.numpy()[:] = pattern
    pool.step_started(STEP)
    conn.send_bytes(pool.info.to_json())  # raw bytes and JSON: never pickle
    while (command := conn.recv_bytes().decode()) != "exit":
        if command == "done":
            pool.step_done(STEP)
        else:
            pool.layer_done(STEP, int(command.split()[1]))
        conn.send_bytes(b"ok")


class Owner:
    """A forked owner process and the test's end of its pipe (bytes only)."""

    def __init__(self) -> None:
        ctx = mp.get_context("fork")  # no torch work in the child: forking is safe and fast
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=owner, args=(child,), daemon=True)
        self.process.start()
        self.info = SharedMemoryInfo.from_json(self.conn.recv_bytes())

    def command(self, command: str) -> None:
        """Report progress ("layer N" or "done") and wait until it is in the header."""
        self.conn.send_bytes(command.encode())
        self.conn.recv_bytes()

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send_bytes(b"exit")
        self.process.join(5)


@contextlib.contextmanager
def pulling(**receiver_args):
    """A live owner and a receiver, both let go afterwards."""
    owner_, receiver = Owner(), Receiver(**receiver_args)
    try:
        yield owner_, receiver
    finally:
        owner_.stop()
        receiver.close()


def expected_blocks(block_ids) -> torch.Tensor:
    pattern = np.random.default_rng(0).integers(
        0, 255, OWNER_BLOCKS * KvCache.bytes_per_block(**GEOMETRY), dtype=np.uint8
    )
    return torch.from_numpy(pattern).view(OWNER_BLOCKS, -1)[list(block_ids)]  # raw bytes


class Receiver:
    """The receiving worker's side: its own pool, a tensor thread, cancelled tags."""

    def __init__(self, timeout_s: float = 30.0, min_streamed_copy_bytes: int = 0) -> None:
        """`min_streamed_copy_bytes` 0: every layer is copied as soon as it is final."""
        self.cache = KvCache(num_blocks=16, **GEOMETRY)
        self.executor = ThreadPoolExecutor(max_workers=1)
        self.cancelled: set[int] = set()
        self.copies = 0
        self.puller = KvPuller(
            self.cache,
            self._on_thread,
            self.cancelled.__contains__,
            timeout_s,
            min_streamed_copy_bytes,
        )

    async def _on_thread(self, fn, *args):
        self.copies += 1
        return await asyncio.wrap_future(self.executor.submit(fn, *args))

    async def pull(self, info, src, dst, tag=1, ready_step=STEP):
        async def no_wait():
            return None

        source = KvSource("owner", (info,), tuple(src), ready_step)
        return await self.puller.pull(tag, source, dst, no_wait)

    def blocks(self, ids) -> torch.Tensor:
        """Raw bytes of the blocks (random bytes include NaNs: compare bytes)."""
        return self.cache.data[list(ids)].reshape(len(ids), -1).view(torch.uint8)

    def close(self) -> None:
        self.puller.close()
        self.executor.shutdown()


SRC, DST = [3, 4, 5, 11, 2], [0, 1, 2, 9, 15]


def test_pulled_blocks_are_bit_identical():
    with pulling() as (owner, receiver):
        owner.command("done")
        result = asyncio.run(receiver.pull(owner.info, SRC, DST))
        assert torch.equal(receiver.blocks(DST), expected_blocks(SRC))
        assert result.num_bytes == len(DST) * receiver.cache.block_bytes
        assert result.source_lag_seconds >= 0
        assert float(receiver.cache.data[[3, 4, 5]].abs().sum()) == 0  # nothing else written


def test_layers_are_copied_as_the_owner_finishes_them():
    layers = GEOMETRY["num_layers"]

    def expected_layer(ids, layer):
        return expected_blocks(ids).view(len(ids), layers, -1)[:, layer]

    async def run(owner, receiver):
        def layer_view(ids, layer):
            return receiver.cache.data[list(ids), layer].reshape(len(ids), -1).view(torch.uint8)

        task = asyncio.create_task(receiver.pull(owner.info, SRC, DST))
        for done in range(layers - 1):
            owner.command(f"layer {done}")
            deadline = time.monotonic() + 5
            while not torch.equal(layer_view(DST, done), expected_layer(SRC, done)):
                assert time.monotonic() < deadline, f"layer {done} was not copied"
                await asyncio.sleep(0.005)
            assert float(layer_view(DST, done + 1).abs().sum()) == 0  # not final yet: not copied
            assert not task.done()
        owner.command("done")
        return await asyncio.wait_for(task, 5)

    with pulling() as (owner, receiver):
        result = asyncio.run(run(owner, receiver))
        assert torch.equal(receiver.blocks(DST), expected_blocks(SRC))
        # The owner's last layer ended just before: the lag is measured, and small.
        assert 0 < result.source_lag_seconds < 5


def test_a_small_transfer_is_copied_once_when_its_last_layer_is_final():
    """Below the streamed-copy size, ready layers wait for the rest: one copy at the end."""

    async def run(owner, receiver):
        task = asyncio.create_task(receiver.pull(owner.info, SRC, DST))
        for layer in range(GEOMETRY["num_layers"] - 1):
            owner.command(f"layer {layer}")
            await asyncio.sleep(0.02)
        assert receiver.copies == 0 and not task.done()
        owner.command("done")
        return await asyncio.wait_for(task, 5)

    with pulling(min_streamed_copy_bytes=1 << 30) as (owner, receiver):
        asyncio.run(run(owner, receiver))
        assert receiver.copies == 1
        assert torch.equal(receiver.blocks(DST), expected_blocks(SRC))


def test_a_cancelled_pull_stops_and_writes_nothing_more():
    async def run(owner, receiver):
        task = asyncio.create_task(receiver.pull(owner.info, SRC, DST, tag=5))
        await asyncio.sleep(0.05)
        receiver.cancelled.add(5)
        with pytest.raises(KvTransferCancelled, match="cancelled"):
            await asyncio.wait_for(task, 5)
        owner.command("done")  # the owner finishes later: the cancelled pull copies nothing

    with pulling() as (owner, receiver):
        asyncio.run(run(owner, receiver))
        assert float(receiver.cache.data.abs().sum()) == 0


def test_final_kv_survives_its_owner_being_killed():
    """Blocks already final are copied whole even after the owner died: the mapping keeps
    its memory."""
    with pulling() as (owner, receiver):
        receiver.puller.peer("owner", owner.info)  # mapped while it lived (as a worker would)
        owner.command("done")
        owner.kill()
        owner.process.join(5)
        asyncio.run(receiver.pull(owner.info, SRC, DST))
        assert torch.equal(receiver.blocks(DST), expected_blocks(SRC))


def test_owner_killed_mid_stream_50_times_fails_each_pull_fast_and_the_receiver_lives():
    rng = np.random.default_rng(1)

    async def killed_mid_stream(receiver, owner, tag) -> float:
        task = asyncio.create_task(receiver.pull(owner.info, SRC, DST, tag=tag))
        await asyncio.sleep(float(rng.uniform(0, 0.02)))
        owner.kill()
        killed = time.monotonic()
        with pytest.raises(KvTransferError, match="exited before its KV was final"):
            await asyncio.wait_for(task, 10)
        return time.monotonic() - killed

    receiver = Receiver(timeout_s=60.0)  # the kill must be seen, not a timeout
    slowest = 0.0
    try:
        for round_ in range(50):
            owner = Owner()
            for layer in range(int(rng.integers(0, GEOMETRY["num_layers"]))):
                owner.command(f"layer {layer}")
            slowest = max(slowest, asyncio.run(killed_mid_stream(receiver, owner, round_ + 1)))
            owner.stop()
        assert slowest < 1.0, f"a pull took {slowest:.3f}s to see its owner die"
        # Still a working receiver: a live owner's blocks arrive whole.
        owner = Owner()
        owner.command("done")
        asyncio.run(receiver.pull(owner.info, SRC, DST, tag=999))
        assert torch.equal(receiver.blocks(DST), expected_blocks(SRC))
        owner.stop()
    finally:
        receiver.close()


def test_a_pull_from_a_process_that_is_not_the_owner_is_refused():
    with pulling() as (owner, receiver):
        info = owner.info
        forged = type(info)(info.host_id, info.pid, info.fd, info.num_bytes, b"x" * 16)
        with pytest.raises(KvTransferError, match="another token"):
            asyncio.run(receiver.pull(forged, SRC, DST))
        with pytest.raises(KvTransferError, match="outside the peer's pool"):
            asyncio.run(receiver.pull(info, [OWNER_BLOCKS], [0]))
