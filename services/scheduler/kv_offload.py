"""The KV offload tiers of one pool, as its scheduler manages them: full blocks the pool
computes are also written to the worker's host-memory offload blocks
(`--kv-offload-cpu-bytes`), and, when the host tier lets one go, to the disk tier behind
it (`--kv-offload-dir`); a prefix the pool's prefix cache has evicted is loaded back
instead of recomputed.

The host tier is a second block pool with its own prefix-cache index (same keys, so
`cache_salt`, adapter and deployment isolation hold in it) and its own LRU: every offload
block not held for a disk load is free and cached, least recently saved or hit first
out. The scheduler decides every copy, so it knows what the host tier holds:
- `saves`: each block newly cached in the device pool and not yet in the tier gets an
  offload block (evicting the LRU one); the worker copies it there after the step's
  forward pass (`BlockMoves.offload_out`), when the block's KV is complete. Write-through:
  a block is saved while it is surely intact, and never on the path of the allocation
  that would evict it (docs/architecture.md, *KV offload*). A block evicted from the host
  tier that the disk tier lacks is written there first (`disk_saves`, before the
  `offload_out` that reuses its offload block in the same step).
- `hits_for`: the blocks after a request's device prefix hit that the host tier holds, in
  a run; the worker copies them into the request's fresh device blocks before the forward
  pass (`BlockMoves.offload_in`), in the same step that computes the rest of the prompt.
  Loads run before saves, so an offload block hit and reused in one step is read first.
- The disk tier is the worker's (`services/worker/disk_offload.py`); here it is an index
  of block hashes (what the worker said it holds at start, plus what was written since,
  less what it reports gone). When a request's run continues on disk, the blocks are
  read into offload blocks held for them (`disk_loads`) and the request waits: the
  step's result says which loaded (they join the host tier, newest) and which failed
  (gone from the index); the request then starts from whatever its tiers hold, and
  computes the rest. A bad file is never served.
Pure Python.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from common.step_plan import DiskBlock
from services.scheduler.block_pool import BlockPool, Uncached
from services.scheduler.request import Request

WAIT = None  # `hits_for`: the request waits for blocks being read from disk


class HostOffload:
    def __init__(
        self, num_blocks: int, block_size: int, disk_hashes: Iterable[bytes] | None = None
    ) -> None:
        """`disk_hashes`: the blocks the worker's disk tier holds (None: it has none)."""
        self.pool = BlockPool(num_blocks, enable_caching=True, record_events=True)
        self.block_size = block_size
        self.disk: dict[bytes, None] | None = (
            None if disk_hashes is None else dict.fromkeys(disk_hashes)
        )
        self._roots: dict[int, bytes] = {}  # offload block -> its chain's salted root
        self._saved_now: set[int] = set()  # offload blocks this plan writes into
        # Disk reads under way: block hash -> (offload block held for it, its tokens).
        self._loading: dict[bytes, tuple[int, tuple[int, ...]]] = {}
        self.num_saved_blocks = 0
        self.num_loaded_blocks = 0
        self.num_hit_tokens = 0
        self.num_query_tokens = 0
        self.num_disk_saved_blocks = 0
        self.num_disk_loaded_blocks = 0
        self.num_disk_failed_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached

    @property
    def num_disk_blocks(self) -> int:
        return 0 if self.disk is None else len(self.disk)

    def begin_plan(self) -> None:
        self._saved_now.clear()

    # -- saving ------------------------------------------------------------------------------
    def saves(
        self, cached: Sequence[tuple[int, Hashable, Sequence[int]]], root: bytes
    ) -> tuple[list[tuple[int, int]], list[DiskBlock]]:
        """(device block, offload block) copies for blocks newly cached on the device
        (`(block, key, tokens)` of a chain from `root`), and the disk writes of the blocks
        they push out of the host tier; a block the tier holds already is only refreshed."""
        pairs, disk_saves = [], []
        for device_block, key, tokens in cached:
            held = self.pool.lookup(key, tokens)
            if held is not None:
                self._refresh(held)
                continue
            if len(self._saved_now) >= self.pool.num_free:
                break  # every block not held for a disk read is written by this step
            self.pool.take_events()
            (block,) = self.pool.allocate(1)  # evicts the LRU one
            demoted = self._demote(block, self.pool.take_events())
            if demoted is not None:
                disk_saves.append(demoted)
            self.pool.cache(block, key, tokens)
            self.pool.decref([block])  # free again, at the tail: the newest
            self._roots[block] = root
            self._saved_now.add(block)
            pairs.append((device_block, block))
        self.num_saved_blocks += len(pairs)
        self.num_disk_saved_blocks += len(disk_saves)
        return pairs, disk_saves

    def _demote(self, block: int, events) -> DiskBlock | None:
        """The disk write of what `block` held, when the host tier just let it go."""
        evicted = next((e.key for e in events if isinstance(e, Uncached)), None)
        root = self._roots.pop(block, None)
        if evicted is None or self.disk is None or root is None:
            return None
        if block in self._saved_now or evicted in self.disk:
            return None  # its bytes land only after this step's forward pass / on disk
        self.disk[evicted] = None
        return DiskBlock(evicted, root, block)

    # -- hits ---------------------------------------------------------------------------------
    def hits_for(
        self, request: Request, num_device_hits: int
    ) -> tuple[list[int], list[DiskBlock]] | None:
        """For a request that starts from scratch (block hashes current): the offload
        blocks holding its next blocks after its `num_device_hits` device prefix hits,
        and the disk reads of the blocks after those that the disk tier holds (the
        request waits for them); WAIT while some are still being read. Nothing for a
        request that asks for prompt logprobs (every position is computed)."""
        if request.num_computed_tokens or request.sampling.prompt_logprobs is not None:
            return [], []
        keys, tokens = request.block_hashes, request.all_token_ids
        bs = self.block_size
        end = min(len(keys), (request.num_known_tokens - 1) // bs)
        found, index = [], num_device_hits
        while index < end:
            block = self.pool.lookup(keys[index], tokens[index * bs : (index + 1) * bs])
            if block is None:
                break
            found.append(block)
            index += 1
        for block in found:
            self._refresh(block)
        reads = []
        while index < end and self.disk is not None:
            key = keys[index]
            if key in self._loading:
                return WAIT
            if key not in self.disk or not self.pool.num_free:
                break
            # Held until the read is done. What it held is not written to disk: the read
            # lands before this step's disk writes would run.
            (block,) = self.pool.allocate(1)
            self.pool.take_events()
            self._loading[key] = (block, tuple(tokens[index * bs : (index + 1) * bs]))
            self._roots[block] = request.hash_root
            reads.append(DiskBlock(key, request.hash_root, block))
            index += 1
        return found, reads

    def loaded(self, num_blocks: int) -> None:
        """A request admitted with `num_blocks` loaded from the host tier (counters)."""
        self.num_loaded_blocks += num_blocks
        self.num_hit_tokens += num_blocks * self.block_size

    def disk_results(
        self, loaded: Iterable[bytes], failed: Iterable[bytes], removed: Iterable[bytes]
    ) -> None:
        """A step's disk reads are done (loaded blocks join the host tier, newest first
        out last; failed ones leave the disk index), and blocks the disk tier let go."""
        for key in loaded:
            block, tokens = self._loading.pop(key)
            self.pool.cache(block, key, tokens)
            self.pool.decref([block])
            self.num_disk_loaded_blocks += 1
        for key in failed:
            block, _ = self._loading.pop(key)
            self._roots.pop(block, None)
            self.pool.decref([block])
            self.disk.pop(key, None)
            self.num_disk_failed_blocks += 1
        for key in removed:
            if self.disk is not None and key not in self._loading:
                self.disk.pop(key, None)
        self.pool.take_events()

    def _refresh(self, block: int) -> None:
        self.pool.touch([block])
        self.pool.decref([block])

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        if self.pool.num_free != self.pool.num_blocks - len(self._loading):
            raise AssertionError("an offload block is held outside a disk read")
