"""One rank's part of KV transfers over UCX, the same for every rank of every worker (a
one-process worker is rank 0 of a layout of one), commanded by rank 0's `LayoutTransfers`
(another rank's commands come through its step pipe, rank 0's own are calls); each answers
`answer(tag, op, error)` when its UCX half ends.

- `KV_SEND`: gather this rank's slices of the blocks (on the step thread) and send one
  message per destination rank to that rank's UCX worker; answer `sent`.
- `KV_RECV`: post one receive per source rank into buffers of this rank's own; answer
  `received` when all have arrived.
- `KV_SCATTER`: the received buffers into this rank's pool (on the step thread).
- `KV_DROP`: give the transfer up (`UcxTransport` completes receives still posted; their
  buffers never reach the pool, nor are they reused).

UCX runs on `loop`: rank 0's event loop, or on another rank an event-loop thread of its own
(`on_own_thread`), so its steps never wait for the network.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.kv_rank_messages import RankMessage, rank_tag, slices_from_wire
from common.log import get_logger
from services.worker.kv_transfer import TransferDeadline, UcxTransport, all_or_cancel
from services.worker.parallel.kv_message_io import (
    StagingBuffers,
    as_tensor,
    gather_message,
    scatter_message,
)
from services.worker.parallel.rank_channel import (
    ANSWER,
    KV_DROP,
    KV_RECV,
    KV_SCATTER,
    KV_SEND,
    write_json,
)

log = get_logger(__name__)
KV_KINDS = (KV_SEND, KV_RECV, KV_SCATTER, KV_DROP)
# A scatter comes after this rank answered `received`; its coroutine ends right after.
SCATTER_WAIT_S = 10.0


@dataclass
class _Receive:
    block_ids: list[int]
    parts: list[tuple[RankMessage, object]]  # (message, its staging buffer)
    done: concurrent.futures.Future


class RankKv:
    def __init__(
        self,
        rank: int,
        pool: torch.Tensor,
        first_layer: int,
        transport: UcxTransport,
        loop: asyncio.AbstractEventLoop,
        answer: Callable[[int, str, str | None], None],
    ) -> None:
        """`pool`: this rank's KV pool; `first_layer`: where it starts on the layer axis of
        the transfers' slices."""
        self.rank, self.pool, self.first_layer = rank, pool, first_layer
        self.transport, self._loop, self._answer = transport, loop, answer
        self.staging = StagingBuffers(device=pool.device)
        self._receives: dict[int, _Receive] = {}

    @classmethod
    def on_own_thread(
        cls,
        rank: int,
        pool: torch.Tensor,
        first_layer: int,
        answer_fd: int,
        deadline: TransferDeadline,
        error_handling: bool,
    ) -> RankKv:
        """A peer rank's part: a UCX worker on an event-loop thread of its own, answering
        on the pipe to rank 0."""
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="ucx", daemon=True).start()

        async def start() -> UcxTransport:
            if pool.device.type == "cuda":  # UCX's CUDA transports need a current context
                torch.cuda.set_device(pool.device)
            transport = UcxTransport(deadline.cap_s, error_handling, deadline)
            _ = transport.address  # UCX's context starts here, on this loop
            return transport

        def answer(tag: int, op: str, error: str | None) -> None:
            write_json(answer_fd, ANSWER, {"tag": tag, "op": op, "error": error})

        transport = asyncio.run_coroutine_threadsafe(start(), loop).result()
        return cls(rank, pool, first_layer, transport, loop, answer)

    @property
    def address(self) -> bytes:
        return self.transport.address

    def handle(self, kind: bytes, body: dict) -> None:
        """One command from rank 0."""
        tag = int(body["tag"])
        if kind == KV_SEND:
            self._send(tag, body)
        elif kind == KV_RECV:
            self._receive(tag, body)
        elif kind == KV_SCATTER:
            self._scatter(tag)
        elif kind == KV_DROP:
            receive = self._receives.pop(tag, None)
            if receive is not None:
                receive.done.cancel()
        else:
            raise ValueError(f"unknown KV command {kind!r}")

    def _buffer(self, message: RankMessage, num_blocks: int):
        _, _, _, slots, _, dim = self.pool.shape
        return self.staging.acquire(
            message.nbytes(num_blocks, slots, dim, self.pool.element_size())
        )

    def _send(self, tag: int, body: dict) -> None:
        block_ids = [int(b) for b in body["blocks"]]
        sends = []
        try:
            for item in body["messages"]:
                message = RankMessage(
                    self.rank, int(item["dst_rank"]), slices_from_wire(item["slices"])
                )
                buffer = self._buffer(message, len(block_ids))
                gather_message(self.pool, block_ids, message, self.first_layer, as_tensor(buffer))
                sends.append((item["peer"], base64.b64decode(item["address"]), buffer))
            if self.pool.device.type == "cuda":  # UCX copies on its own streams
                torch.cuda.current_stream(self.pool.device).synchronize()
        except Exception as exc:  # a bad command: rank 0 fails the transfer
            self._answer(tag, "sent", f"gather failed: {exc!r}")
            return
        asyncio.run_coroutine_threadsafe(self._send_all(tag, sends), self._loop)

    async def _send_all(self, tag: int, sends) -> None:
        mine = rank_tag(tag, self.rank)
        try:
            await all_or_cancel(
                [self.transport.send(peer, address, mine, buf) for peer, address, buf in sends]
            )
        except Exception as exc:  # (a failed send's buffer may still be held by UCX)
            self._answer(tag, "sent", str(exc))
            return
        for *_, buffer in sends:
            self.staging.release(buffer)
        self._answer(tag, "sent", None)

    def _receive(self, tag: int, body: dict) -> None:
        block_ids = [int(b) for b in body["blocks"]]
        try:
            parts = []
            for item in body["messages"]:
                message = RankMessage(
                    int(item["src_rank"]), self.rank, slices_from_wire(item["slices"])
                )
                parts.append((message, self._buffer(message, len(block_ids))))
        except Exception as exc:
            self._answer(tag, "received", f"bad receive: {exc!r}")
            return
        done = asyncio.run_coroutine_threadsafe(self._receive_all(tag, parts), self._loop)
        self._receives[tag] = _Receive(block_ids, parts, done)

    async def _receive_all(self, tag: int, parts) -> None:
        try:
            await all_or_cancel(
                [
                    self.transport.receive(rank_tag(tag, m.src_rank), buffer.nbytes, out=buffer)
                    for m, buffer in parts
                ]
            )
        except Exception as exc:  # (a drop cancels this: no answer, rank 0 no longer waits)
            self._answer(tag, "received", str(exc))
            return
        self._answer(tag, "received", None)

    def _scatter(self, tag: int) -> None:
        receive = self._receives.pop(tag, None)
        try:  # answered already: its coroutine is ending (it answers before it returns)
            if receive is None:
                raise KeyError(tag)
            receive.done.result(timeout=SCATTER_WAIT_S)
        except Exception as exc:
            log.error("kv_scatter_without_receive", tag=tag, rank=self.rank, error=repr(exc))
            raise RuntimeError(f"rank {self.rank}: scatter of transfer {tag:#x} without "
                               "its receive") from exc  # fmt: skip
        for message, buffer in receive.parts:
            scatter_message(
                self.pool, receive.block_ids, message, self.first_layer, as_tensor(buffer)
            )
        if self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()
        for _, buffer in receive.parts:
            self.staging.release(buffer)

    def drop_all(self) -> None:
        for receive in self._receives.values():
            receive.done.cancel()
        self._receives.clear()

    def close(self) -> None:
        """A peer rank's: its receives dropped, its UCX worker and its thread ended."""
        self.drop_all()
        try:
            coroutine = asyncio.wait_for(self.transport.close(), timeout=5.0)
            asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()
        except Exception as exc:  # ending anyway
            log.warning("ucx_close_failed", rank=self.rank, error=repr(exc)[:300])
        self._loop.call_soon_threadsafe(self._loop.stop)
