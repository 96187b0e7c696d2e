"""How the fake workers of one test move KV blocks (`tests/fake_worker.py`): the fabric (the
UCX address book, tagged messages, one change signal every waiter listens to) and the
fakes' `SendKv`, and a plan's KV loads (UCX or a shared-memory pull), with their injected
faults. A send completes when the load took the data; the load waits until the steps before
its plan ran, gives up when its tag is cancelled, and is reported with a step result."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.step_plan import KvLoad, KvSource
from common.step_result import KvLoadDone
from services.scheduler.worker_types import WorkerInfo, WorkerUnavailableError

if TYPE_CHECKING:
    from tests.fake_worker import FakeWorker


@dataclass
class _Slot:
    """One tagged message between two workers."""

    payload: list[list[int | None]] | None = None
    taken: bool = False
    dead: bool = False


class FakeFabric:
    """What connects the fakes of one test: the UCX address book, tagged messages, and one
    change signal every waiter in every fake listens to."""

    def __init__(self) -> None:
        self.workers: dict[bytes, FakeWorker] = {}
        self.slots: dict[tuple[bytes, int], _Slot] = {}
        self._event: asyncio.Event | None = None

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    def by_id(self, worker_id: str) -> FakeWorker:
        return next(w for w in self.workers.values() if w.info.worker_id == worker_id)

    def next_change(self) -> asyncio.Event:
        """The event the next `notify` sets: take it right after checking a condition (no
        await in between), so no change can slip by."""
        if self._event is None:
            self._event = asyncio.Event()
        return self._event


class FakeKvTransfers:
    """The KV half of `FakeWorker` (a mixin over its state)."""

    def _start_load(self, load: KvLoad, step_id: int) -> None:
        """Plan `step_id`'s load: written once the steps before it ran, reported with the
        next step result."""
        tag, blocks, after = load.tag, list(load.block_ids), step_id - 1
        self.receive_tags.append(tag)
        if load.source is not None:
            self.pull_tags.append(tag)
            if self.refuse_pulls:
                refused = KvLoadDone(tag, error="cannot map the shared pool", pull_refused=True)
                self._loads_done.append(refused)
                self.fabric.notify()
                return
            serve = self._serve_pull(tag, blocks, self.kv_load_timeout_s, after, load.source)
        else:
            serve = self._serve_receive(tag, blocks, self.kv_load_timeout_s, after)
        self._receives[tag] = self._spawn(self._report(tag, serve, self._stream))

    async def _report(self, tag: int, serve, stream: int) -> None:
        try:
            done = await serve
        except (WorkerUnavailableError, ValueError, asyncio.CancelledError) as exc:
            done = KvLoadDone(tag, error=str(exc) or "cancelled")
        if self._stream == stream:  # a new stream (or a kill) forgets the old one's loads
            self._loads_done.append(done)
            self.fabric.notify()

    def _fault(self, tag: int) -> str | None:
        return "transfer failed (injected)" if self._faulty(tag, "fail") else None

    async def _serve_send(
        self, tag: int, peer: WorkerInfo, block_ids: list[int], timeout_s: float
    ) -> KvLoadDone:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        target = self.fabric.workers.get(peer.ucx_address)

        def peer_gone() -> str | None:
            if target is None or target.killed:
                return f"peer {peer.worker_id} unreachable"
            return self._fault(tag)

        # Gather queued behind the steps already sent (as on the tensor thread).
        last_sent = self._step_id
        await self._until(
            lambda: not self._faulty(tag, "hang") and self.executed_step_id >= last_sent,
            deadline,
            f"SendKv {tag:#x}",
            failure=peer_gone,
        )
        self._checked(block_ids)
        payload = [list(self._block(b)) for b in block_ids]
        slot = self.fabric.slots.setdefault((peer.ucx_address, tag), _Slot())
        slot.payload = payload
        self.fabric.notify()

        def undeliverable() -> str | None:
            if slot.dead:
                return "the receiver gave up"
            return peer_gone()

        try:
            await self._until(
                lambda: slot.taken, deadline, f"SendKv {tag:#x}", failure=undeliverable
            )
        except WorkerUnavailableError:
            slot.dead = True
            raise
        return KvLoadDone(tag, num_bytes=len(block_ids) * self.info.block_bytes)

    async def _serve_receive(
        self, tag: int, block_ids: list[int], timeout_s: float, after_step_id: int
    ) -> KvLoadDone:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        key = (self.info.ucx_address, tag)
        slot = self.fabric.slots.setdefault(key, _Slot())

        def cancelled() -> str | None:
            if tag in self._cancelled:
                return f"transfer {tag:#x} was cancelled"
            return self._fault(tag)

        try:
            self._checked(block_ids)
            await self._until(
                lambda: not self._faulty(tag, "hang") and slot.payload is not None,
                deadline,
                f"KV load {tag:#x}",
                failure=cancelled,
            )
            if len(slot.payload) != len(block_ids):
                raise WorkerUnavailableError(
                    f"KV load {tag:#x}: {len(slot.payload)} blocks sent, {len(block_ids)} expected"
                )
            slot.taken = True
            self.fabric.notify()
            await self._until(
                lambda: self.executed_step_id >= after_step_id,
                deadline,
                f"KV load {tag:#x}",
                failure=lambda: (
                    f"transfer {tag:#x} was cancelled" if tag in self._cancelled else None
                ),
            )
            # Checked and written in one go (no await between), as the real worker does.
            if tag in self._cancelled:
                raise WorkerUnavailableError(f"transfer {tag:#x} was cancelled")
            for block_id, content in zip(block_ids, slot.payload, strict=True):
                self.kv[block_id] = list(content)
            self.kv_blocks_received += len(block_ids)
            if self.after_kv_received is not None:
                await self.after_kv_received(tag)
            return KvLoadDone(tag, num_bytes=len(block_ids) * self.info.block_bytes)
        except BaseException:
            slot.dead = True
            self.fabric.notify()
            raise
        finally:
            if self._receives.get(tag) is asyncio.current_task():
                del self._receives[tag]
            if slot.taken and not slot.dead:
                self.fabric.slots.pop(key, None)  # a dead slot stays: late sends fail

    async def _serve_pull(
        self,
        tag: int,
        block_ids: list[int],
        timeout_s: float,
        after_step_id: int,
        source: KvSource,
    ) -> KvLoadDone:
        """Copy blocks straight out of a peer's pool once the peer has run the step that
        makes them final (the fake writes a step's KV at once, not layer by layer)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        peer = self.fabric.by_id(source.worker_id)

        def failure() -> str | None:
            if tag in self._cancelled:
                return f"transfer {tag:#x} was cancelled"
            if peer._killed:
                return f"{peer.address} exited before its KV was final"
            return self._fault(tag)

        try:
            self._checked(block_ids)
            await self._until(
                lambda: (
                    not self._faulty(tag, "hang")
                    and peer.executed_step_id >= source.ready_step_id
                    and self.executed_step_id >= after_step_id
                ),
                deadline,
                f"KV load {tag:#x}",
                failure=failure,
            )
            for block_id, src in zip(block_ids, source.block_ids, strict=True):
                self.kv[block_id] = peer.block_tokens(src)
            self.kv_blocks_received += len(block_ids)
            if self.after_kv_received is not None:
                await self.after_kv_received(tag)
            return KvLoadDone(tag, num_bytes=len(block_ids) * self.info.block_bytes)
        finally:
            if self._receives.get(tag) is asyncio.current_task():
                del self._receives[tag]
