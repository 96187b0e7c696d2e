"""The prefill → decode hand-off (docs/architecture.md, "A request's path" and "KV
connectors"): which decode pool pulls a finished prompt, which of its blocks that pool
already holds (prefix cache, offload tiers: `handoff_tier`), and moving the rest with the
peers' connector (`PeerKvConnector`: a load in the decode pool's plan, `kv_peer_connector`),
at once or streamed chunk by chunk (`stream`).

Hazards:
- A load is written only after the decode worker has run the steps planned before it, so
  a step still in flight never writes into freshly received KV.
- A cancelled or failed transfer frees the prefill side at once; the decode side's blocks
  stay held until that pool's next plan carries the tag (`PeerLoads.cancel`): a load still
  under way on the worker may write into them until it learns the tag.
- Nothing is called back: what the engine must act on goes into `events`, each with the
  request's `moves` then, so the engine ignores it once the request has moved on.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from itertools import count

from common.log import bind_request, get_logger
from common.parallel_plan import Layout
from common.step_plan import KvLoad, KvSource
from common.step_result import KvLoadDone
from common.tracing import current_carrier
from services.scheduler.handle import RequestHandle, Stage, Transfer, TransferPart
from services.scheduler.handoff_tier import NO_RUN, TierRun
from services.scheduler.kv_retention import retain_finished
from services.scheduler.link_breaker import LinkBreaker
from services.scheduler.placement import DecodeCandidate, choose_decode
from services.scheduler.pool import Pool
from services.scheduler.request_trace import transfer_span
from services.scheduler.worker_types import KvPullRefusedError, WorkerUnavailableError

log = get_logger(__name__)


@dataclass(frozen=True)
class Stranded:
    """No decode pool is left for the request: it must end."""

    handle: RequestHandle
    moves: int
    why: str


@dataclass(frozen=True)
class TransferFailed:
    """The request's transfer failed; both sides' blocks are released already."""

    handle: RequestHandle
    moves: int
    src: Pool
    dst: Pool
    error: BaseException


@dataclass(frozen=True)
class Parked:
    """A finished request that keeps its KV arrived: its decode pool holds its blocks."""

    handle: RequestHandle
    moves: int


HandoffEvent = Stranded | TransferFailed | Parked


class PeerKvConnector:
    """How one part of a hand-off's blocks moves: a load in the receiving pool's next plan
    (`kv_peer_connector.PeerLoads`); on one host the receiver pulls the blocks out of the
    sender's shared pool, else a `SendKv` on the sender runs beside the load with the same
    UCX tag. A pair whose receiver could not map the sender's pool uses UCX from then on."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        # (source, receiver) worker ids whose receiver could not map the source's pool.
        self._no_pull: set[tuple[str, str]] = set()

    def can_pull(self, src: Pool, dst: Pool) -> bool:
        """`dst`'s worker copies KV straight out of `src`'s pool (same host: it can stream it)."""
        pool = src.info.shared_memory
        reachable = pool is not None and pool.reachable_from(dst.info.shared_memory)
        return reachable and (src.info.worker_id, dst.info.worker_id) not in self._no_pull

    def failed(self, src: Pool, dst: Pool, error: BaseException) -> None:
        """A move between the two failed with `error`."""
        if isinstance(error, KvPullRefusedError):  # from now on these two use UCX
            self._no_pull.add((src.info.worker_id, dst.info.worker_id))
            log.warning("kv_pull_refused", src=src.info.worker_id, dst=dst.info.worker_id)

    async def move(self, src: Pool, dst: Pool, tag: int, part: TransferPart) -> KvLoadDone:
        """One part of a transfer, as a load in `dst`'s next plan (written there only after
        the steps planned before it; `KvHandoff` gives it up with `PeerLoads.cancel`)."""
        info, source = src.info, None
        layout = Layout(info.tensor_parallel_size, info.pipeline_parallel_size)
        if self.can_pull(src, dst):
            pools = (info.shared_memory, *info.rank_shared_memory)
            source = KvSource(
                info.worker_id, pools, tuple(part.src_blocks), part.ready_step_id, layout
            )
        # The transfer's span, when traced.
        load = KvLoad(tag, tuple(part.dst_blocks), source, layout, *current_carrier())
        if source is not None:
            return await self._load(dst, load)
        send = src.client.send_kv(tag, dst.info, list(part.src_blocks), self.timeout_s)
        calls = [asyncio.ensure_future(self._load(dst, load)), asyncio.ensure_future(send)]
        try:  # the first failure raises here; the other call is cancelled
            return (await asyncio.gather(*calls))[0]
        finally:
            for call in calls:
                call.cancel()

    async def _load(self, dst: Pool, load: KvLoad) -> KvLoadDone:
        outcome_of = dst.scheduler.peer_loads.start(load)
        dst.wakeup.set()  # an idle pool plans the step that carries it
        try:
            outcome = await asyncio.wait_for(outcome_of, self.timeout_s)
        except TimeoutError:
            raise WorkerUnavailableError(
                f"KV load {load.tag:#x} on {dst.info.address}: no outcome in {self.timeout_s}s"
            ) from None
        if outcome.pull_refused:
            raise KvPullRefusedError(f"KV load on {dst.info.address}: {outcome.error}")
        if outcome.error:
            raise WorkerUnavailableError(
                f"KV load {load.tag:#x} on {dst.info.address} failed: {outcome.error}"
            )
        return outcome


class KvHandoff:
    def __init__(
        self,
        decode_pools: Sequence[Pool],
        timeout_s: float,
        spawn: Callable[[Coroutine, str], asyncio.Task],
        streaming: bool = True,
        links: LinkBreaker | None = None,
    ) -> None:
        """`spawn(coro, name)` runs a transfer's task."""
        self.decode_pools = list(decode_pools)
        self.peers = PeerKvConnector(timeout_s)  # how the blocks move
        self.streaming = streaming
        self._spawn = spawn
        self.events: asyncio.Queue[HandoffEvent] = asyncio.Queue()
        self.queue: deque[RequestHandle] = deque()
        # (source, receiver) links whose last transfer failed with both workers alive.
        self.links = links or LinkBreaker()
        self._tags = count((secrets.randbits(31) << 32) + 1)
        # request -> the outcome of its decode pool's disk reads (`handoff_tier`), awaited
        # by its transfer: the places in its table of the blocks that must move after all.
        self._disk_reads: dict[str, asyncio.Future[list[int]]] = {}

    def enqueue(self, handle: RequestHandle) -> None:
        """The request's prompt is done: wait for a decode pool to pull it (or, streamed
        already, for its transfer to end)."""
        handle.await_handoff()
        transfer = handle.transfer
        if transfer is not None:  # streamed while the prompt ran (see `stream`)
            handle.start_transfer(transfer)
            if transfer.done:
                self._arrive(handle, transfer.src, transfer.dst)
            return
        self.queue.append(handle)
        if not self.fail_if_stranded():
            self.wake_decode_pools()

    def wake_decode_pools(self) -> None:
        """Room may have changed: let every decode pool that could take a hand-off look."""
        if self.queue:
            for pool in self.decode_pools:
                if pool.accepting:
                    pool.wakeup.set()

    def fail_if_stranded(self) -> bool:
        """With no healthy decode pool left, fail every waiting hand-off (True)."""
        if any(p.healthy for p in self.decode_pools):
            return False
        for stranded in list(self.queue):
            self.events.put_nowait(Stranded(stranded, stranded.moves, "no decode worker left"))
        return True

    def remove(self, handle: RequestHandle) -> None:
        self.queue.remove(handle)

    def cancel(self, handle: RequestHandle, free_source: bool = True) -> None:
        """Give up the handle's transfer now: stop its calls and release both sides (the
        source side only when `free_source`: a prompt still running keeps its blocks in
        its pool's scheduler, which frees them)."""
        transfer = handle.transfer
        if transfer is not None:
            transfer.task.cancel()
            self._release(handle, free_source)

    def _release(self, handle: RequestHandle, free_source: bool = True) -> None:
        """Free the transfer's blocks: the prefill side's now, the decode side's once the
        plan that tells the worker the tag is dead is made."""
        transfer, handle.transfer = handle.transfer, None
        rid = handle.request.request_id
        if free_source:
            transfer.src.blocks.free(rid)
        transfer.dst.scheduler.peer_loads.cancel(transfer.tag, rid)
        if transfer.dst.scheduler.offload is not None:  # its tier loads and reads, if any
            transfer.dst.scheduler.offload.handoff.drop(rid)
        self._disk_reads.pop(rid, None)
        transfer.src.wakeup.set()
        transfer.dst.wakeup.set()

    def pull(self, pool: Pool) -> None:
        """`pool` plans a step: start the waiting hand-offs that choose it, in order. Stops
        at the first that no pool has room for, or that chooses another pool (woken).
        First, the transfers waiting for `pool`'s disk reads learn how they went."""
        offload = pool.scheduler.offload
        if offload is not None and offload.handoff.outcomes:
            for rid, failed in offload.handoff.take_outcomes().items():
                waiter = self._disk_reads.pop(rid, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(failed)
        while self.queue and pool.accepting:
            handle = self.queue[0]
            choice = self._choose(handle.request, handle.request.num_computed_tokens, handle.pool)
            if choice is None:
                return  # wait until a decode pool frees blocks
            dst, hits, tier = choice
            if dst is not pool:
                dst.wakeup.set()
                return
            self.queue.popleft()
            self._start(handle, pool, hits, tier)

    def stream(self, handle: RequestHandle, step_id: int, last: bool) -> None:
        """Step `step_id`, just sent to the handle's prefill pool, computes a chunk of its
        prompt (the last one when `last`): the blocks it completes move as one part, which
        the decode worker pulls layer by layer as the prefill worker writes them. The first
        chunk starts the transfer only if a same-host decode pool would take the whole
        prompt now and no hand-off waits ahead; otherwise the prompt is handed off as usual."""
        request, transfer, src = handle.request, handle.transfer, handle.pool
        if transfer is None:
            # Not for a request whose first token ends it: no decode step would use the KV.
            if not self.streaming or self.queue or request.ends_at_its_next_token:
                return
            # The whole prompt: every known token (not the one its last step samples).
            choice = self._choose(request, request.num_known_tokens, handle.pool)
            if choice is None:
                return
            dst, hits, tier = choice
            whole = dst.blocks.blocks_for_tokens(request.num_known_tokens)
            if not self.peers.can_pull(src, dst) or len(hits) + tier.num_blocks >= whole:
                return
            transfer = self._start(handle, dst, hits, tier, streamed=True)
        table = src.blocks.table(request.request_id)
        transfer.add_part(table, src.blocks.full_blocks(request.num_computed_tokens), step_id, last)

    def _choose(self, request, computed: int, src: Pool) -> tuple[Pool, list[int], TierRun] | None:
        """The decode pool placement picks for the request's first `computed` tokens now
        (held in `src`), its cached blocks, and the run of its offload tiers' blocks after
        those (`handoff_tier`: loaded there, not moved). Links from `src` that just failed
        a transfer are left out while another is usable."""
        healthy = [p for p in self.decode_pools if p.accepting]  # draining ones: no
        if not healthy:
            return None
        usable = self.links.usable(src.info.worker_id, [p.info.worker_id for p in healthy])
        healthy = [healthy[i] for i in usable]
        hits = [
            p.blocks.cached_prefix(request.block_hashes, request.all_token_ids, computed)
            for p in healthy
        ]
        tiers = [
            NO_RUN if p.scheduler.offload is None
            else p.scheduler.offload.handoff.hits(request, len(h), computed)
            for p, h in zip(healthy, hits, strict=True)
        ]  # fmt: skip
        needed = healthy[0].blocks.blocks_for_tokens(computed)
        choice = choose_decode(
            [
                DecodeCandidate(
                    transfer_blocks=needed - len(h) - t.num_blocks,
                    consumed_blocks=p.blocks.blocks_needed(
                        request.request_id, computed, hits=h, next_position=max(0, computed - 1)
                    ),
                    free_blocks=p.blocks.num_free_blocks,
                )
                for p, h, t in zip(healthy, hits, tiers, strict=True)
            ]
        )
        return None if choice is None else (healthy[choice], hits[choice], tiers[choice])

    def _start(
        self,
        handle: RequestHandle,
        dst: Pool,
        hits: list[int],
        tier: TierRun,
        streamed: bool = False,
    ) -> Transfer | None:
        """Allocate the request's blocks in `dst`, load the first from its offload tiers
        (`tier`) and start moving the rest: at once, or streamed part by part (`stream`;
        `enqueue` moves the request on once its prompt is done)."""
        request, src = handle.request, handle.pool
        rid = request.request_id
        num_tokens = request.num_known_tokens if streamed else request.num_computed_tokens
        # Windowed groups' blocks no decode query reads get the null block.
        dst_blocks, _ = dst.blocks.allocate(
            rid, num_tokens, hits=hits, next_position=max(0, num_tokens - 1)
        )
        dst.counters.kv_blocks_reused += len(hits)
        first, reads = len(hits), None
        if tier.num_blocks:  # loaded from the decode pool's tiers, not moved
            covered = dst.scheduler.offload.handoff.hold(
                request, tier, dst_blocks[: tier.num_blocks]
            )
            dst_blocks, first = dst_blocks[covered:], first + covered
            if covered > len(tier.host):  # read from its disk: the transfer waits for them
                reads = asyncio.get_running_loop().create_future()
                self._disk_reads[rid] = reads
                dst.wakeup.set()  # (an idle pool plans the step that reads them)
        if not dst_blocks and reads is None:  # the decode pool already holds every block
            handle.start_transfer(None)
            self._arrive(handle, src, dst)
            return None
        tag = next(self._tags)
        parts: asyncio.Queue[TransferPart] = asyncio.Queue()
        task = self._spawn(self._transfer(handle, src, dst, tag, parts, reads), f"kv-{rid}")
        transfer = Transfer(task, src, dst, tag, parts, dst_blocks, first, first)
        if streamed:
            handle.transfer = transfer
        else:
            table = src.blocks.table(rid)
            transfer.add_part(table, len(table), handle.ready_step_in(src), last=True)
            handle.start_transfer(transfer)
        return transfer

    async def _transfer(
        self,
        handle: RequestHandle,
        src: Pool,
        dst: Pool,
        tag: int,
        parts: asyncio.Queue[TransferPart],
        reads: asyncio.Future[list[int]] | None,
    ) -> None:
        """Move the parts as they come, in order, until the last; then, with disk reads on
        the decode pool (`reads`), wait for their outcome (the decode pool's step that read
        them has answered) and move the blocks whose read failed. Cancelled (the request
        ended) it stops the calls under way; `cancel` has released the blocks."""
        request = handle.request
        rid, src_id, dst_id = request.request_id, src.info.worker_id, dst.info.worker_id
        started = time.perf_counter()
        num_blocks = num_bytes = 0
        lag_s = 0.0
        try:
            # current while the calls run: they carry it to workers
            with transfer_span(handle.trace, request, src_id, dst_id) as current:
                while True:
                    part = await parts.get()
                    if part.dst_blocks:
                        result = await self.peers.move(src, dst, tag, part)
                        num_blocks += len(part.dst_blocks)
                        num_bytes += result.num_bytes
                        lag_s = result.source_lag_seconds
                    if part.last:
                        break
                if reads is not None and (failed := await reads):
                    # Their KV comes from the prefill worker after all: final there by now.
                    tables = src.blocks.table(rid), dst.blocks.table(rid)
                    src_blocks, dst_blocks = ([table[i] for i in failed] for table in tables)
                    ready = handle.ready_step_in(src)
                    part = TransferPart(src_blocks, dst_blocks, ready, last=True)
                    num_blocks += len(failed)
                    num_bytes += (await self.peers.move(src, dst, tag, part)).num_bytes
                if current is not None:
                    current.set_attributes(
                        {"tandem.kv.blocks": num_blocks, "tandem.kv.bytes": num_bytes}
                    )
        except Exception as error:
            self.peers.failed(src, dst, error)
            if handle.stage is Stage.PREFILL:
                # Streamed while the prompt still runs: drop the decode side; the finished
                # prompt is handed off as usual (a dead worker is found by its step stream).
                self._release(handle, free_source=False)
                with bind_request(rid, request.trace_id):
                    log.warning("kv_stream_failed", dst=dst_id, error=str(error))
                return
            self._release(handle)
            cool_down = self.links.failed(src_id, dst_id)
            log.warning("kv_link_avoided", src=src_id, dst=dst_id, seconds=cool_down)
            self.events.put_nowait(TransferFailed(handle, handle.moves, src, dst, error))
            return
        self.links.succeeded(src_id, dst_id)
        dst.counters.kv_blocks_received += num_blocks
        dst.counters.kv_transfers += 1
        dst.counters.kv_source_lag_s += lag_s
        with bind_request(rid, request.trace_id):
            log.debug(
                "kv_transferred",
                src=src_id,
                dst=dst_id,
                blocks=num_blocks,
                bytes=num_bytes,
                seconds=round(time.perf_counter() - started, 5),
                source_lag_ms=round(lag_s * 1e3, 3),
            )
        if handle.stage is Stage.PREFILL:  # streamed, and the prompt's result is not in yet
            handle.transfer.done = True
            return
        self._arrive(handle, src, dst)

    def _arrive(self, handle: RequestHandle, src: Pool, dst: Pool) -> None:
        request = handle.request
        rid = request.request_id
        # Its prompt leaves the prefill pool: kept there too if it asked (`kv_retention`).
        retain_finished(src.blocks, src.scheduler.offload, request)
        src.blocks.free(rid)
        src.wakeup.set()
        cached = dst.blocks.cache_full_blocks(
            rid,
            request.block_hashes,
            request.all_token_ids,
            request.num_computed_tokens,
            request.chain_origin,
        )
        if dst.scheduler.offload is not None:  # kept in its tier too (`handoff_tier`)
            dst.scheduler.offload.handoff.save_arrival(rid, cached, request.hash_root)
        handle.arrive(dst)
        dst.wakeup.set()
        if not request.is_finished:
            dst.scheduler.add(request)
        else:  # a finished one that keeps its KV parks here
            self.events.put_nowait(Parked(handle, handle.moves))
