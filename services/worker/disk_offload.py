"""The worker's side of the KV offload's disk tier (`--kv-offload-dir`,
`--kv-offload-disk-bytes`): it runs a step's `disk_saves` and `disk_loads` between the
host-memory offload pool and the files of `kv_offload.DiskTier`, and says what happened.

- Saves (before the forward pass, before the step's disk reads and `offload_out` may
  reuse the offload blocks): each block is copied out of its offload block at once, and
  the file written on a thread of its own, so the step does not wait for the disk. A
  save carries the block's retention deadline (`DiskBlock.retain_until`); one of a block
  the disk holds already only extends that deadline (no copy, no write).
- Deadlines (`disk_retains`, before the saves): a finished retained request's blocks
  that only the disk holds get their later deadline; the file is renamed on the writer
  thread, in order with the writes before it (nothing is copied or written; a block the
  tier no longer has is left alone).
- Loads (before the forward pass, into offload blocks the scheduler holds for them): a
  load first waits for a write of the same block still under way, then reads and
  verifies the file into the offload block. A missing, truncated, corrupt or foreign file
  is a failed load, never served; the scheduler then computes those tokens.
- `take_removed`: the blocks the tier let go since the last call (its LRU, files found
  bad), for the scheduler's index. Components report; nothing calls back.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from common.log import get_logger
from common.step_plan import DiskBlock, DiskRetain
from services.worker.kv_cache import KvCache
from services.worker.kv_offload.disk_tier import DiskTier
from services.worker.kv_offload.keys import BlockKey, Evicted

log = get_logger(__name__)


class DiskOffload:
    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-disk")
        self._writes: dict[bytes, Future] = {}  # block hash -> its write, until taken
        self._older: list[Future] = []  # writes of a block saved again since, until taken
        self.num_saved = 0
        self.num_loaded = 0
        self.num_failed = 0

    @property
    def capacity_blocks(self) -> int:
        return self.tier.capacity_blocks

    def hashes(self) -> list[bytes]:
        """The blocks on disk now, oldest first."""
        return [key.block_hash for key in self.tier.keys()]

    def retain(self, blocks: Sequence[DiskRetain]) -> None:
        """Move each block's deadline on disk (a rename, in the background, after the
        writes queued before it)."""
        for block in blocks:
            key = BlockKey(block.block_hash)
            self._track(
                block.block_hash, self._writer.submit(self.tier.retain, key, block.retain_until)
            )

    def save(self, blocks: Sequence[DiskBlock], pool: KvCache) -> None:
        """Copy each block out of its offload block now; write the files in the background
        (in order, on one thread). A retained block on disk already: its deadline only."""
        for block in blocks:
            key = BlockKey(block.block_hash)
            if block.retain_until and self.tier.contains(key):
                write = self._writer.submit(self.tier.retain, key, block.retain_until)
            else:
                payload = pool.bytes[block.offload_block].reshape(-1).clone()
                write = self._writer.submit(
                    self.tier.put, key, block.root, payload, block.retain_until
                )
                self.num_saved += 1
            self._track(block.block_hash, write)

    def _track(self, block_hash: bytes, write: Future) -> None:
        """The block's latest write (a load of it waits for it; `take_removed` reports
        what it evicted)."""
        older = self._writes.get(block_hash)
        if older is not None:  # its evictions are still to be reported
            self._older.append(older)
        self._writes[block_hash] = write

    def load(self, blocks: Sequence[DiskBlock], pool: KvCache) -> tuple[list[bytes], list[bytes]]:
        """Read and verify each block into its offload block: (loaded, failed) hashes."""
        loaded, failed = [], []
        for block in blocks:
            write = self._writes.get(block.block_hash)
            if write is not None:
                write.exception()  # wait (its evictions are collected by take_removed)
            out = pool.bytes[block.offload_block]
            got = self.tier.get(BlockKey(block.block_hash), block.root, out=out)
            (loaded if got is not None else failed).append(block.block_hash)
        self.num_loaded += len(loaded)
        self.num_failed += len(failed)
        return loaded, failed

    def take_removed(self) -> list[bytes]:
        """Blocks the tier let go since the last call (evicted by its LRU, or bad files)."""
        removed: list[Evicted] = []
        done = [(h, w) for h, w in self._writes.items() if w.done()]
        older, self._older = self._older, []
        for write in older:  # each asked once (one that finishes meanwhile waits)
            if write.done():
                done.append((None, write))
            else:
                self._older.append(write)
        for block_hash, write in done:
            if block_hash is not None:
                del self._writes[block_hash]
            if write.exception() is not None:  # stored nothing: a load will miss
                log.error("kv_disk_write_failed", error=repr(write.exception()))
                continue
            removed.extend(write.result())
        removed.extend(self.tier.take_dropped())
        return [e.key.block_hash for e in removed]

    def close(self) -> None:
        self._writer.shutdown(wait=True)
