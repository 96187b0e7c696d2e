"""KV transfers over UCX where either worker is parallel (tensor or pipeline ranks): rank 0's
side. `common.kv_rank_messages` cuts the transfer into one message per (source rank,
destination rank) pair; every rank sends and receives its own messages with its own UCX
worker, so each destination rank gets exactly its KV heads of its layers straight from the
source rank that holds them (nothing gathers through rank 0). Rank 0 does its own part and
commands the other ranks' parts through their step pipes (`parallel/peer_kv.py`), then
waits for their answers.

Sending: the other ranks' commands and rank 0's gather are queued on the tensor thread, so
every rank gathers after the same steps. Receiving: every rank receives into buffers of
its own; once all have arrived and the transfer's step has run, rank 0 scatters its part
and commands the others' scatters from the tensor thread (ordered with the steps, exactly
as a one-process receive). A failure or cancel on any rank fails the whole transfer and
drops every rank's receives; no buffer is written into a pool after that."""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable, Sequence

import torch

from common.kv_rank_messages import (
    RankMessage,
    message_nbytes,
    rank_messages,
    rank_tag,
    slices_to_wire,
)
from common.parallel_plan import Layout
from services.worker.kv_transfer import (
    KvTransferCancelled,
    KvTransferError,
    UcxTransport,
    all_or_cancel,
)
from services.worker.parallel.kv_message_io import gather_message, new_buffer, scatter_message
from services.worker.parallel.kv_ranks import KvGeometry
from services.worker.parallel.peer_ranks import PeerRanks, RankTransferError
from services.worker.parallel.rank_channel import KV_DROP, KV_RECV, KV_SCATTER, KV_SEND


class LayoutTransfers:
    def __init__(
        self,
        geometry: KvGeometry,
        layout: Layout,
        pool: torch.Tensor,
        transport: UcxTransport,
        peers: PeerRanks | None,
        on_tensor_thread: Callable[..., Awaitable],
    ) -> None:
        """`pool`: rank 0's pool (the first stage's layers, its KV heads)."""
        self.geometry = geometry
        self.layout = layout
        self.pool = pool
        self.transport = transport
        self.peers = peers
        self._on_tensor_thread = on_tensor_thread
        self._plans: dict[tuple[Layout, Layout], list[RankMessage]] = {}

    def messages(self, src: Layout, dst: Layout) -> list[RankMessage]:
        if (src, dst) not in self._plans:
            self._plans[(src, dst)] = rank_messages(self.geometry.plan(src, dst))
        return self._plans[(src, dst)]

    def _nbytes(self, message: RankMessage, num_blocks: int) -> int:
        g = self.geometry
        return message_nbytes(
            message, num_blocks, g.block_size, g.head_dim, self.pool.element_size()
        )

    def _by_rank(self, messages: list[RankMessage], sending: bool) -> dict[int, list]:
        out: dict[int, list[RankMessage]] = {}
        for m in messages:
            out.setdefault(m.src_rank if sending else m.dst_rank, []).append(m)
        if set(out) - {0} and self.peers is None:
            raise KvTransferError("a plan for other ranks in a one-process worker")
        return out

    async def send(
        self,
        tag: int,
        peer_id: str,
        dst: Layout,
        addresses: Sequence[bytes],
        block_ids: Sequence[int],
    ) -> int:
        """Send the blocks to a worker of layout `dst` whose ranks' UCX addresses are
        `addresses` (rank order); returns the bytes every rank sent together."""
        if len(addresses) != dst.world_size or not all(addresses):
            raise KvTransferError(
                f"{peer_id} is {dst.tp} x {dst.pp} ranks but described "
                f"{sum(1 for a in addresses if a)} UCX addresses"
            )
        messages = self.messages(self.layout, dst)
        by_rank = self._by_rank(messages, sending=True)
        others = {r: m for r, m in by_rank.items() if r != 0}
        answers = [self.peers.expect(tag, "sent", r) for r in others]
        try:
            staged = await self._on_tensor_thread(
                self._command_and_gather, tag, peer_id, addresses, list(block_ids),
                by_rank.get(0, []), others,
            )  # fmt: skip
            await all_or_cancel(
                [
                    *(
                        self.transport.send(f"{peer_id}/rank{m.dst_rank}",
                                            addresses[m.dst_rank], tag, wire)
                        for m, wire in staged
                    ),
                    *answers,
                ]
            )  # fmt: skip
        except RankTransferError as exc:
            raise KvTransferError(f"send of transfer {tag:#x} failed on {exc}") from exc
        finally:
            if self.peers is not None:
                self.peers.forget(tag)
        return sum(self._nbytes(m, len(block_ids)) for m in messages)

    def _command_and_gather(self, tag, peer_id, addresses, block_ids, mine, others):
        """On the tensor thread: the other ranks' sends (each gathers after the same steps
        as this one), then rank 0's own messages gathered into fresh buffers (a failed
        send's buffer may still be held by UCX)."""
        for rank, messages in others.items():
            body = {
                "tag": tag,
                "blocks": block_ids,
                "messages": [
                    {
                        "dst_rank": m.dst_rank,
                        "peer": f"{peer_id}/rank{m.dst_rank}",
                        "address": base64.b64encode(addresses[m.dst_rank]).decode(),
                        "slices": slices_to_wire(m.pieces),
                    }
                    for m in messages
                ],
            }
            self.peers.command(rank, KV_SEND, body)
        staged = []
        for m in mine:
            wire, flat = new_buffer(self._nbytes(m, len(block_ids)), self.pool.device)
            gather_message(self.pool, block_ids, m, 0, flat)
            staged.append((m, wire))
        if self.pool.device.type == "cuda":  # UCX copies on its own streams
            torch.cuda.current_stream(self.pool.device).synchronize()
        return staged

    async def receive(
        self,
        tag: int,
        src: Layout,
        block_ids: Sequence[int],
        wait_for_step: Callable[[], Awaitable[None]],
        is_cancelled: Callable[[int], bool],
    ) -> int:
        """Receive the blocks from a worker of layout `src`: every rank its own messages;
        written into the pools after `wait_for_step` and unless cancelled by then."""
        block_ids = list(block_ids)
        messages = self.messages(src, self.layout)
        by_rank = self._by_rank(messages, sending=False)
        others = {r: m for r, m in by_rank.items() if r != 0}
        answers = [self.peers.expect(tag, "received", r) for r in others]
        for rank, rank_messages_ in others.items():
            body = {
                "tag": tag,
                "blocks": block_ids,
                "messages": [
                    {"src_rank": m.src_rank, "slices": slices_to_wire(m.pieces)}
                    for m in rank_messages_
                ],
            }
            self.peers.command(rank, KV_RECV, body)
        parts = [(m, *new_buffer(self._nbytes(m, len(block_ids)), self.pool.device))
                 for m in by_rank.get(0, [])]  # fmt: skip
        try:
            await all_or_cancel(
                [
                    *(
                        self.transport.receive(rank_tag(tag, m.src_rank), flat.numel(), out=wire)
                        for m, wire, flat in parts
                    ),
                    *answers,
                ]
            )
            await wait_for_step()
            # Checked and queued in one go (no await between), as a one-process receive.
            if is_cancelled(tag):
                raise KvTransferCancelled(f"transfer {tag:#x} was cancelled")
            await self._on_tensor_thread(self._scatter, tag, block_ids, parts, list(others))
        except RankTransferError as exc:
            self._drop(tag, others)
            raise KvTransferError(f"receive of transfer {tag:#x} failed on {exc}") from exc
        except BaseException:
            self._drop(tag, others)
            raise
        finally:
            if self.peers is not None:
                self.peers.forget(tag)
        return sum(self._nbytes(m, len(block_ids)) for m in messages)

    def _drop(self, tag: int, others) -> None:
        for rank in others:
            self.peers.command(rank, KV_DROP, {"tag": tag})

    def _scatter(self, tag: int, block_ids: list[int], parts, others: list[int]) -> None:
        """On the tensor thread: every rank's received messages into its pool."""
        for rank in others:
            self.peers.command(rank, KV_SCATTER, {"tag": tag})
        for m, _, flat in parts:
            scatter_message(self.pool, block_ids, m, 0, flat)
        if self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()
