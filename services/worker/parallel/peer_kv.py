"""A peer rank's own part of KV transfers over UCX: its UCX worker (on an event-loop thread
of its own, so steps never wait for the network), the commands rank 0 sends it through the
step pipe, and its answers on the pipe back.

- `KV_SEND`: gather this rank's slices of the blocks (on the step thread, so after every
  step rank 0 queued before it) and send one message per destination rank, to that rank's
  UCX worker; answer `sent` when UCX is done.
- `KV_RECV`: post one receive per source rank into buffers of this rank's own; answer
  `received` when all have arrived.
- `KV_SCATTER`: the received buffers into this rank's pool (rank 0 sends it from its tensor
  thread once every rank has received and the transfer's step has run: ordered with steps).
- `KV_DROP`: give the transfer up (receives still posted are completed by UCX's own
  mechanism in `UcxTransport`; their buffers are never written into the pool).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import threading
from dataclasses import dataclass

import torch

from common.kv_rank_messages import RankMessage, message_nbytes, rank_tag, slices_from_wire
from common.log import get_logger
from services.worker.kv_transfer import TransferDeadline, UcxTransport, all_or_cancel
from services.worker.parallel.kv_message_io import gather_message, new_buffer, scatter_message
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
    parts: list[tuple[RankMessage, torch.Tensor]]
    done: concurrent.futures.Future


class PeerKvTransfers:
    def __init__(
        self,
        rank: int,
        pool: torch.Tensor,
        first_layer: int,
        answer_fd: int,
        deadline: TransferDeadline,
        error_handling: bool,
    ) -> None:
        """`pool`: this rank's KV pool; `first_layer`: the model layer it starts at."""
        self.rank = rank
        self.pool = pool
        self.first_layer = first_layer
        self._answer_fd = answer_fd
        self._receives: dict[int, _Receive] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ucx", daemon=True)
        self._thread.start()
        self.transport = self._run(self._start(deadline, error_handling, pool.device))
        self.address = self.transport.address

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    @staticmethod
    async def _start(deadline: TransferDeadline, error_handling: bool, device: torch.device):
        if device.type == "cuda":  # UCX's CUDA transports need a current context here
            torch.cuda.set_device(device)
        transport = UcxTransport(deadline.cap_s, error_handling, deadline)
        _ = transport.address  # UCX's context starts here, on this loop
        return transport

    def handle(self, kind: bytes, body: dict) -> None:
        """One command from rank 0 (on the step thread)."""
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

    def _answer(self, tag: int, op: str, error: str | None = None) -> None:
        write_json(self._answer_fd, ANSWER, {"tag": tag, "op": op, "error": error})

    def _message_bytes(self, message: RankMessage, num_blocks: int) -> int:
        _, _, _, slots, _, dim = self.pool.shape
        return message_nbytes(message, num_blocks, slots, dim, self.pool.element_size())

    def _send(self, tag: int, body: dict) -> None:
        block_ids = [int(b) for b in body["blocks"]]
        sends = []
        try:
            for item in body["messages"]:
                message = RankMessage(
                    self.rank, int(item["dst_rank"]), slices_from_wire(item["slices"])
                )
                wire, flat = new_buffer(
                    self._message_bytes(message, len(block_ids)), self.pool.device
                )
                gather_message(self.pool, block_ids, message, self.first_layer, flat)
                address = base64.b64decode(item["address"])
                sends.append((item["peer"], address, wire))
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
                [self.transport.send(peer, address, mine, wire) for peer, address, wire in sends]
            )
        except Exception as exc:
            self._answer(tag, "sent", str(exc))
            return
        self._answer(tag, "sent")

    def _receive(self, tag: int, body: dict) -> None:
        block_ids = [int(b) for b in body["blocks"]]
        try:
            parts = []
            for item in body["messages"]:
                message = RankMessage(
                    int(item["src_rank"]), self.rank, slices_from_wire(item["slices"])
                )
                wire, flat = new_buffer(
                    self._message_bytes(message, len(block_ids)), self.pool.device
                )
                parts.append((message, wire, flat))
        except Exception as exc:
            self._answer(tag, "received", f"bad receive: {exc!r}")
            return
        done = asyncio.run_coroutine_threadsafe(self._receive_all(tag, parts), self._loop)
        self._receives[tag] = _Receive(block_ids, [(m, flat) for m, _, flat in parts], done)

    async def _receive_all(self, tag: int, parts) -> None:
        try:
            await all_or_cancel(
                [
                    self.transport.receive(rank_tag(tag, m.src_rank), flat.numel(), out=wire)
                    for m, wire, flat in parts
                ]
            )
        except asyncio.CancelledError:  # dropped: rank 0 no longer waits
            raise
        except Exception as exc:
            self._answer(tag, "received", str(exc))
            return
        self._answer(tag, "received")

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
        for message, flat in receive.parts:
            scatter_message(self.pool, receive.block_ids, message, self.first_layer, flat)
        if self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()

    def close(self) -> None:
        for receive in self._receives.values():
            receive.done.cancel()
        self._receives.clear()
        try:
            self._run(asyncio.wait_for(self.transport.close(), timeout=5.0))
        except Exception as exc:  # ending anyway
            log.warning("ucx_close_failed", rank=self.rank, error=repr(exc)[:300])
        self._loop.call_soon_threadsafe(self._loop.stop)
