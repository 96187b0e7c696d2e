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

Beside a GPU the host tier is page-locked and its copies run on a stream of their own
(`SideStream`): a step's saves overlap what follows the forward pass (the scheduler's
update, the next plan), and the compute stream waits for them, on the device, only
before the next step writes; loads are queued there and the forward pass waits for them
on the device. The CPU reads or writes offload blocks (the disk tier) only after the
saves queued before are done.

A parallel worker's ranks each run the connector on their slices, the disk tier in files
of their own; a disk read counts as loaded only where it loaded on every rank (`agree`:
a MIN over the ranks), so a file missing or bad on one rank is a miss for all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from common.step_plan import BlockMoves
from services.worker.batch import PlanError
from services.worker.disk_offload import DiskOffload
from services.worker.kv_cache import KvCache, block_runs
from services.worker.kv_connector import KvConnector


class SideStream:
    """Whole-block copies between a CUDA pool and its page-locked tier on a stream of
    their own, one copy per run of consecutive blocks (pinned slices copy asynchronously)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.saved: torch.cuda.Event | None = None  # the last saves queued
        self.last: torch.cuda.Event | None = None  # the last copies of either kind queued
        self._timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def copy(self, dst: KvCache, src: KvCache, pairs: Sequence[tuple[int, int]]) -> None:
        """`dst[d] = src[s]` for each (s, d), queued on the side stream after what the
        compute stream queued so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            runs = block_runs([p[0] for p in pairs], [p[1] for p in pairs])
            for s, d, n in runs:
                dst.bytes[d : d + n].copy_(src.bytes[s : s + n], non_blocking=True)

    def loads(self, dst: KvCache, src: KvCache, pairs) -> None:
        """Queue the loads, timed on the device; the compute stream waits for them there."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        self.copy(dst, src, pairs)
        end.record(self.stream)
        self.last, self._timing = end, (start, end)
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def load_seconds(self) -> float | None:
        """How long the last loads took (once they are done: after the forward pass that
        waited for them); None when none were timed since the last call."""
        if self._timing is None:
            return None
        (start, end), self._timing = self._timing, None
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def saves(self, dst: KvCache, src: KvCache, pairs) -> None:
        self.copy(dst, src, pairs)
        self.saved = self.last = self.stream.record_event()

    def before_step(self) -> None:
        """A step may write blocks the last saves still read: the compute stream waits."""
        if self.saved is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self.saved)

    def before_host_access(self) -> None:
        """The CPU is about to read or write offload blocks: the copies queued must be done
        (saves write them, loads read them)."""
        if self.last is not None:
            self.last.synchronize()


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
        self._side = SideStream(kv_cache.device) if kv_cache.device.type == "cuda" else None

    def start_load_kv(self, moves: BlockMoves, step_id: int) -> None:
        finished: dict = {}
        if self._side is not None:
            self._side.before_step()
        if moves.disk_saves or moves.disk_loads or moves.disk_retains:
            if self.disk is None:
                raise PlanError("the plan moves disk tier blocks but this worker has none")
            if self._side is not None:
                self._side.before_host_access()
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
        if moves.offload_in and self._side is not None:
            self._side.loads(self.kv_cache, self.offload_cache, moves.offload_in)
        elif moves.offload_in:
            started = time.perf_counter()
            self.kv_cache.copy_blocks(moves.offload_in, source=self.offload_cache)
            finished["offload_load_seconds"] = time.perf_counter() - started
        self._finished = finished

    def wait_for_save(self, moves: BlockMoves, step_id: int) -> None:
        if moves.offload_out and self._side is not None:
            self._side.saves(self.offload_cache, self.kv_cache, moves.offload_out)
        elif moves.offload_out:
            self.offload_cache.copy_blocks(moves.offload_out, source=self.kv_cache)

    def get_finished(self) -> dict:
        finished, self._finished = self._finished, {}
        seconds = None if self._side is None else self._side.load_seconds()
        if seconds is not None:
            finished["offload_load_seconds"] = seconds
        if self.disk is not None:
            removed = self.disk.take_removed()
            if removed or finished:
                finished["disk_removed"] = tuple(removed)
        return finished

    async def close(self) -> None:
        if self._side is not None:
            self._side.before_host_access()
        if self.disk is not None:
            self.disk.close()  # every file in flight written
