"""The offload tiers' connector (`--kv-offload-cpu-bytes`, then `--kv-offload-dir`): the
host-memory offload pool and, behind it, the disk tier (`disk_offload`), at a step's
connector points (`kv_connector`).

- `start_load_kv`: the disk tier's writes (a block the host tier lets go, copied out at
  once and written on the disk tier's thread), then its reads into offload blocks, then
  the offload blocks' loads into the pool (`offload_in`), timed.
- `wait_for_layer_load` (beside a GPU): the compute stream waits for one layer's loads.
- `wait_for_save`: after the forward pass, the blocks it filled saved into the offload
  pool (`offload_out`, write-through).
- `get_finished`: what the disk tier read, failed to read and let go, and the seconds the
  loads took (the scheduler's tier index and metrics follow them).

Beside a GPU the host tier is page-locked and its copies run on a stream of their own
(`kv_side_stream.SideStream`): a step's saves overlap what follows the forward pass (the
scheduler's update, the next plan), and the compute stream waits for them, on the
device, only before the next step writes; loads are queued there layer slot by layer
slot and each layer's attention waits, on the device, for its own slot only
(`loads_layers`), unless a copy-on-write copy of the step reads a loaded block before the
pass (then the pass waits for all the loads). The CPU reads or writes offload blocks (the
disk tier) only after the copies queued before are done.

On CPU the loads are whole blocks before the pass, on the tensor thread: loading layer by
layer on a thread beside the pass was measured slower there (`bench.kv_layer_loads`; the
copies are a few percent of the step, and a loader thread takes a core from the pass).

A parallel worker's ranks each run the connector on their slices, the disk tier in files
of their own; a disk read counts as loaded only where it loaded on every rank (`agree`:
a MIN over the ranks), so a file missing or bad on one rank is a miss for all.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common.step_plan import BlockMoves
from services.worker.batch import PlanError
from services.worker.cuda_pitched_copy import pitched_copy
from services.worker.disk_offload import DiskOffload
from services.worker.kv_cache import KvCache
from services.worker.kv_connector import KvConnector
from services.worker.kv_side_stream import SideStream


class OffloadConnector(KvConnector):
    def __init__(
        self,
        kv_cache: KvCache,
        offload_cache: KvCache,
        disk: DiskOffload | None = None,
        agree: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        """`agree`: a parallel worker's MIN over its ranks (None: one process)."""
        self.kv_cache, self.offload_cache, self.disk = kv_cache, offload_cache, disk
        self._agree = agree
        self._finished: dict = {}
        self.side: SideStream | None = None  # beside a GPU: the tier copies' own stream
        if kv_cache.device.type == "cuda":
            self.side = SideStream(kv_cache.device, pitched_copy())
        self.loads_layers = self.side is not None and self.side.pitched is not None

    def start_load_kv(self, moves: BlockMoves, step_id: int) -> None:
        finished: dict = {}
        if self.side is not None:
            self.side.before_step()
        if moves.disk_saves or moves.disk_loads or moves.disk_retains:
            if self.disk is None:
                raise PlanError("the plan moves disk tier blocks but this worker has none")
            if self.side is not None:
                self.side.before_host_access()
            self.disk.retain(moves.disk_retains)  # deadlines first: the saves may evict
            self.disk.save(moves.disk_saves, self.offload_cache)  # reads may reuse them
            started = time.perf_counter()
            loaded, failed = self.disk.load(moves.disk_loads, self.offload_cache)
            if self._agree is not None and moves.disk_loads:
                here = set(loaded)
                everywhere = self._agree([int(b.block_hash in here) for b in moves.disk_loads])
                pairs = list(zip(moves.disk_loads, everywhere, strict=True))
                loaded = [b.block_hash for b, ok in pairs if ok]
                failed = [b.block_hash for b, ok in pairs if not ok]
            finished["disk_loaded"] = tuple(loaded)
            finished["disk_failed"] = tuple(failed)
            if moves.disk_loads:
                finished["disk_read_seconds"] = time.perf_counter() - started
        if moves.offload_in and self.side is not None:
            loaded_blocks = {d for _, d in moves.offload_in}
            if self.loads_layers and not any(s in loaded_blocks for s, _ in moves.copies):
                self.side.layer_loads(self.kv_cache, self.offload_cache, moves.offload_in)
            else:  # a copy-on-write copy before the pass reads a loaded block
                self.side.loads(self.kv_cache, self.offload_cache, moves.offload_in)
        elif moves.offload_in:
            started = time.perf_counter()
            self.kv_cache.copy_blocks(moves.offload_in, source=self.offload_cache)
            finished["offload_load_seconds"] = time.perf_counter() - started
        self._finished = finished

    def wait_for_layer_load(self, layer: int) -> None:
        self.side.wait_for_layer(layer)

    def wait_for_save(self, moves: BlockMoves, step_id: int) -> None:
        if self.side is not None:
            self.side.finish_loads()  # nothing after the pass reads a block still loading
        if moves.offload_out and self.side is not None:
            self.side.saves(self.offload_cache, self.kv_cache, moves.offload_out)
        elif moves.offload_out:
            self.offload_cache.copy_blocks(moves.offload_out, source=self.kv_cache)

    def get_finished(self) -> dict:
        finished, self._finished = self._finished, {}
        seconds = None if self.side is None else self.side.load_seconds()
        if seconds is not None:
            finished["offload_load_seconds"] = seconds
        if self.disk is not None:
            removed = self.disk.take_removed()
            if removed or finished:
                finished["disk_removed"] = tuple(removed)
        return finished

    async def close(self) -> None:
        if self.side is not None:
            self.side.before_host_access()
        if self.disk is not None:
            self.disk.close()  # every file in flight written
