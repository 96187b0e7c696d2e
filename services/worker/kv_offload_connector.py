"""The offload tiers' connector (`--kv-offload-cpu-bytes`, then `--kv-offload-dir`): the
host-memory offload pool and, behind it, the disk tier (`disk_offload`), at a step's
connector points (`kv_connector`).

- `start_load_kv`: the disk tier's writes (a block the host tier lets go, copied out at
  once and written on the disk tier's thread), then its reads into offload blocks, then
  the offload blocks' loads into the pool (`offload_in`), timed.
- `wait_for_save`: after the forward pass, the blocks it filled saved into the offload
  pool (`offload_out`, write-through).
- `get_finished`: what the disk tier read, failed to read and let go, and the seconds the
  loads took (the scheduler's tier index and metrics follow them).

A parallel worker's ranks each run the connector on their slices, the disk tier in files
of their own; a disk read counts as loaded only where it loaded on every rank (`agree`:
a MIN over the ranks), so a file missing or bad on one rank is a miss for all.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common.step_plan import BlockMoves
from services.worker.batch import PlanError
from services.worker.disk_offload import DiskOffload
from services.worker.kv_cache import KvCache
from services.worker.kv_connector import KvConnector


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

    def start_load_kv(self, moves: BlockMoves, step_id: int) -> None:
        finished: dict = {}
        if moves.disk_saves or moves.disk_loads:
            if self.disk is None:
                raise PlanError("the plan moves disk tier blocks but this worker has none")
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
        if moves.offload_in:
            started = time.perf_counter()
            self.kv_cache.copy_blocks(moves.offload_in, source=self.offload_cache)
            finished["offload_load_seconds"] = time.perf_counter() - started
        self._finished = finished

    def wait_for_save(self, moves: BlockMoves, step_id: int) -> None:
        if moves.offload_out:
            self.offload_cache.copy_blocks(moves.offload_out, source=self.kv_cache)

    def get_finished(self) -> dict:
        finished, self._finished = self._finished, {}
        if self.disk is not None:
            removed = self.disk.take_removed()
            if removed or finished:
                finished["disk_removed"] = tuple(removed)
        return finished

    async def close(self) -> None:
        if self.disk is not None:
            self.disk.close()  # every file in flight written
