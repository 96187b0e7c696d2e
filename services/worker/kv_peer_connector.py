"""The peers' connector: KV between this worker and another, from the step plan's loads
(`KvLoad`): copied out of a same-host peer's shared pool when the load names one
(`kv_pull`, layer by layer as a prefill worker reports them written: `save_kv_layer`),
else received over UCX from every rank of the peer, which sends with `SendKv` under the
load's tag (`kv_layout_transfer`).

A load starts when its plan arrives (`start_loads`) and writes only once the steps before
that plan have run here (steps planned before its blocks were allocated may still write
into them); its outcome (`KvLoadDone`) goes back with the first step result after it ends
(`take_done`). Nothing is written into the pool after a load's cancel (with a plan,
`cancel`): each copy or scatter checks first, on the tensor thread, ordered with steps.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence

from common.log import get_logger
from common.parallel_plan import Layout
from common.step_plan import BlockMoves, KvLoad
from common.step_result import KvLoadDone
from common.tracing import context_from_fields, end_span, start_span
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KvCache
from services.worker.kv_connector import KvConnector
from services.worker.kv_layout_transfer import LayoutTransfers
from services.worker.kv_pull import KvMapError, KvPuller
from services.worker.kv_shared import SharedPool
from services.worker.kv_transfer import (
    KvTransferCancelled,
    KvTransferError,
    TransferDeadline,
    UcxTransport,
)
from services.worker.parallel.kv_ranks import KvGeometry, RankPools
from services.worker.parallel.peer_ranks import PeerRanks

log = get_logger(__name__)
ONE_PROCESS = Layout()
# Cancelled transfer tags remembered (a cancel may arrive before its receive does).
MAX_CANCELLED_TAGS = 65536


class PeerKvConnector(KvConnector):
    def __init__(
        self,
        config: WorkerConfig,
        kv_cache: KvCache,
        geometry: KvGeometry,
        on_tensor_thread: Callable[..., Awaitable],
        copy_on_tensor_thread: Callable[..., Awaitable],
        wait_for_step: Callable[[int], Awaitable],
        progress: SharedPool | None = None,
        peers: PeerRanks | None = None,
        rank_pools: RankPools | None = None,
    ) -> None:
        """`progress`: this worker's shared pool when peers stream its prompts' KV while
        they compute (a prefill worker). `rank_pools`: every rank's pool, for a parallel
        worker's pulls. `wait_for_step(n)` returns once step n has run here."""
        self.kv_cache, self.peers, self._wait_for_step = kv_cache, peers, wait_for_step
        self._can_pull = peers is None or rank_pools is not None  # (every rank's pool mapped)
        self._progress, self._running_step_id = progress, 0
        self.saves_layers = progress is not None
        self.transport = UcxTransport(
            timeout_s=config.kv_transfer_timeout_s,
            error_handling=config.kv_transfer_error_handling,
            deadline=TransferDeadline.from_config(config),
        )
        self._cancelled: OrderedDict[int, None] = OrderedDict()
        self._receives: dict[int, asyncio.Task] = {}  # tag -> its load, while it runs
        # Ended loads not yet reported: (direction, how: ok, cancelled or failed, outcome);
        # `load_ended` is set when one is added.
        self._done: list[tuple[str, str, KvLoadDone]] = []
        self.load_ended = asyncio.Event()
        self._generation = 0  # a reset forgets what loads of before it report
        self.puller = KvPuller(
            kv_cache, copy_on_tensor_thread, self.is_cancelled, config.kv_transfer_timeout_s,
            config.kv_transfer_stream_min_copy_bytes, rank_pools, geometry.groups,
        )  # fmt: skip
        self.layouts = LayoutTransfers(
            geometry, config.layout, kv_cache.data, self.transport, peers, on_tensor_thread
        )

    # The connector points: a prefill worker's progress, read by the peers pulling from it.
    def start_load_kv(self, moves: BlockMoves, step_id: int) -> None:
        if self._progress is not None:
            self._running_step_id = step_id
            self._progress.step_started(step_id)

    def save_kv_layer(self, layer: int) -> None:
        self._progress.layer_done(self._running_step_id, layer)

    def wait_for_save(self, moves: BlockMoves, step_id: int) -> None:
        if self._progress is not None:
            self._progress.step_done(step_id)

    def reset(self) -> None:
        if self._progress is not None:
            self._progress.reset()

    @property
    def receiving(self) -> bool:
        return bool(self._receives)

    # -- loads from a step plan -------------------------------------------------------------
    def start_loads(self, loads: Sequence[KvLoad], step_id: int) -> None:
        """Start plan `step_id`'s loads (on the event loop, once the plan is queued on the
        tensor thread); each writes only after step `step_id - 1` has run here."""
        for load in loads:
            task = asyncio.ensure_future(self._load(load, step_id - 1, self._generation))
            self._receives[load.tag] = task
            task.add_done_callback(lambda done, tag=load.tag: self._ended(tag, done))

    def _ended(self, tag: int, task: asyncio.Task) -> None:
        if self._receives.get(tag) is task:  # (a later part may reuse the tag)
            del self._receives[tag]

    def take_done(self) -> list[tuple[str, str, KvLoadDone]]:
        """Loads that ended since the last call, as (direction, how, outcome): each once."""
        done, self._done = self._done, []
        self.load_ended.clear()
        return done

    def forget_loads(self) -> None:
        """A new step stream: the loads of the old one are cancelled and never reported."""
        self.cancel(list(self._receives))
        self._generation += 1
        self.take_done()

    async def _load(self, load: KvLoad, after_step_id: int, generation: int) -> None:
        direction = "receive" if load.source is None else "pull"
        span = start_span(
            "kv_receive",
            context_from_fields(load.traceparent, load.tracestate),
            attributes={
                "tandem.kv.transfer_tag": f"{load.tag:016x}",
                "tandem.kv.blocks": len(load.block_ids),
                "tandem.kv.mode": "ucx" if load.source is None else "pull",
            },
        )
        outcome, how, started = KvLoadDone(load.tag), "failed", time.perf_counter()
        try:
            self._check_blocks(load.block_ids)
            if load.tag in self._cancelled:
                raise KvTransferCancelled(f"transfer {load.tag:#x} was cancelled")
            wait = functools.partial(self._wait_for_step, after_step_id)
            if load.source is None:  # over UCX, matched by the peer's `SendKv`
                nbytes = await self.layouts.receive(
                    load.tag, load.sender_layout, load.block_ids, wait, self.is_cancelled
                )
                outcome = KvLoadDone(load.tag, nbytes, time.perf_counter() - started)
            elif not self._can_pull:
                raise KvTransferError("a parallel worker without shared pools cannot pull KV")
            else:
                outcome = await self.puller.pull(load.tag, load.source, load.block_ids, wait)
            how = "ok"
        except KvMapError as exc:  # this pair of workers must use UCX
            outcome = KvLoadDone(load.tag, error=str(exc), pull_refused=True)
        except (KvTransferCancelled, asyncio.CancelledError):  # its tag came with a plan
            how = "cancelled"
            outcome = KvLoadDone(load.tag, error=f"transfer {load.tag:#x} was cancelled")
        except ValueError as exc:  # a sender layout this model cannot have
            outcome = KvLoadDone(load.tag, error=f"sender layout: {exc}")
        except KvTransferError as exc:
            outcome = KvLoadDone(load.tag, error=str(exc))
        except Exception as exc:  # a bug: this load fails, never the worker's steps
            log.exception("kv_load_failed", tag=f"{load.tag:#x}")
            outcome = KvLoadDone(load.tag, error=f"{type(exc).__name__}: {exc}")
        end_span(span, error=outcome.error or None)
        if generation == self._generation:
            self._done.append((direction, how, outcome))
            self.load_ended.set()

    def is_cancelled(self, tag: int) -> bool:
        return tag in self._cancelled

    def cancel(self, tags: Iterable[int]) -> None:
        """The scheduler gave up on these receives: none of them may write into the pool
        from now on (their blocks may already belong to another request)."""
        for tag in tags:
            self._cancelled[tag] = None
            self._cancelled.move_to_end(tag)
            task = self._receives.get(tag)
            if task is not None:
                task.cancel()
        while len(self._cancelled) > MAX_CANCELLED_TAGS:
            self._cancelled.popitem(last=False)

    async def send(
        self,
        tag: int,
        peer_id: str,
        peer_address: bytes,
        block_ids: Sequence[int],
        peer_layout: Layout = ONE_PROCESS,
        peer_rank_addresses: Sequence[bytes] = (),
    ) -> int:
        """Send the blocks to the peer's ranks over UCX (`kv_layout_transfer`); returns the
        bytes sent."""
        self._check_blocks(block_ids)
        return await self.layouts.send(
            tag, peer_id, peer_layout, (peer_address, *peer_rank_addresses), block_ids
        )

    def _check_blocks(self, block_ids: Sequence[int]) -> None:
        if not block_ids:
            raise KvTransferError("a transfer needs at least one block")
        bad = [b for b in block_ids if not 0 <= b < self.kv_cache.num_blocks]
        if bad:
            raise KvTransferError(
                f"block ids {bad[:4]} outside the pool of {self.kv_cache.num_blocks}"
            )

    async def close(self) -> None:
        self.puller.close()
        self.layouts.mine.drop_all()
        await self.transport.close()
