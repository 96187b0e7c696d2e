"""KV transfers over UCX, rank 0's side, whatever the two workers' layouts (a one-process
worker is the layout of one). `common.kv_rank_messages` cuts a transfer into one message
per (source rank, destination rank) pair, which the two ranks' own UCX workers exchange
(`parallel/peer_kv.RankKv`), so each destination rank gets exactly its KV heads of its
layers straight from the source rank that holds them. Rank 0 commands every rank's part,
its own included, and awaits their answers.

Sends are commanded on the tensor thread, so every rank gathers after the same steps.
Every rank receives into buffers of its own, never straight into the pool (a UCX receive
cannot be cancelled: a late message must never land in blocks given to someone else);
once all have arrived and the transfer's step has run, the scatters are commanded from the
tensor thread, ordered with the steps. A failure or cancel on any rank drops every rank's
receives: nothing of the transfer is written into a pool after that."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable, Sequence

import torch

from common.kv_rank_messages import RankMessage, rank_messages, slices_to_wire
from common.parallel_plan import Layout
from services.worker.kv_transfer import (
    KvTransferCancelled,
    KvTransferError,
    UcxTransport,
    all_or_cancel,
)
from services.worker.parallel.kv_ranks import KvGeometry
from services.worker.parallel.peer_kv import RankKv
from services.worker.parallel.peer_ranks import PeerRanks, RankAnswers, RankTransferError
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
        """`pool`: rank 0's pool (the first stage's layers, its KV heads); on the running
        event loop, where rank 0's UCX worker runs."""
        self.geometry, self.layout, self.peers = geometry, layout, peers
        self.answers = RankAnswers() if peers is None else peers.answers
        self.mine = RankKv(
            0, pool, 0, transport, asyncio.get_running_loop(),
            lambda tag, op, error: self.answers.settle(0, tag, op, error),
        )  # fmt: skip
        self._on_tensor_thread = on_tensor_thread
        self._plans: dict[tuple[Layout, Layout], list[RankMessage]] = {}

    def messages(self, src: Layout, dst: Layout) -> list[RankMessage]:
        if (src, dst) not in self._plans:
            self._plans[(src, dst)] = rank_messages(self.geometry.plan(src, dst))
        return self._plans[(src, dst)]

    def _nbytes(self, messages: list[RankMessage], num_blocks: int) -> int:
        g, itemsize = self.geometry, self.mine.pool.element_size()
        return sum(m.nbytes(num_blocks, g.block_size, g.head_dim, itemsize) for m in messages)

    def _by_rank(self, messages: list[RankMessage], sending: bool) -> dict[int, list]:
        """The messages each rank of this worker sends (or receives), rank 0 last."""
        out: dict[int, list[RankMessage]] = {}
        for m in messages:
            out.setdefault(m.src_rank if sending else m.dst_rank, []).append(m)
        if set(out) - {0} and self.peers is None:
            raise KvTransferError("a plan for other ranks in a one-process worker")
        return dict(sorted(out.items(), key=lambda item: item[0] == 0))

    def _command(self, ranks, kind: bytes, body: Callable[[int], dict]) -> None:
        for rank in ranks:
            if rank == 0:
                self.mine.handle(kind, body(0))
            else:
                self.peers.command(rank, kind, body(rank))

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
        answers = [self.answers.expect(tag, "sent", r) for r in by_rank]

        def body(rank: int) -> dict:
            return {"tag": tag, "blocks": list(block_ids), "messages": [
                {"dst_rank": m.dst_rank, "peer": f"{peer_id}/rank{m.dst_rank}",
                 "address": base64.b64encode(addresses[m.dst_rank]).decode(),
                 "slices": slices_to_wire(m.pieces)}
                for m in by_rank[rank]
            ]}  # fmt: skip

        try:
            await self._on_tensor_thread(self._command, by_rank, KV_SEND, body)
            await all_or_cancel(answers)
        except RankTransferError as exc:
            raise KvTransferError(f"send of transfer {tag:#x} failed on {exc}") from exc
        finally:
            self.answers.forget(tag)
        return self._nbytes(messages, len(block_ids))

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
        messages = self.messages(src, self.layout)
        by_rank = self._by_rank(messages, sending=False)
        answers = [self.answers.expect(tag, "received", r) for r in by_rank]

        def body(rank: int) -> dict:
            return {"tag": tag, "blocks": list(block_ids), "messages": [
                {"src_rank": m.src_rank, "slices": slices_to_wire(m.pieces)}
                for m in by_rank[rank]
            ]}  # fmt: skip

        try:
            self._command(by_rank, KV_RECV, body)
            await all_or_cancel(answers)
            await wait_for_step()
            # Checked and queued in one go (no await between): a cancel that reaches this
            # worker later comes with a step queued behind the scatters.
            if is_cancelled(tag):
                raise KvTransferCancelled(f"transfer {tag:#x} was cancelled")
            await self._on_tensor_thread(self._command, by_rank, KV_SCATTER, lambda r: {"tag": tag})
        except BaseException as exc:
            self._command(by_rank, KV_DROP, lambda r: {"tag": tag})
            if isinstance(exc, RankTransferError):
                raise KvTransferError(f"receive of transfer {tag:#x} failed on {exc}") from exc
            raise
        finally:
            self.answers.forget(tag)
        return self._nbytes(messages, len(block_ids))
