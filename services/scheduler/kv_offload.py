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
  tier that the disk tier lacks is written there first (`disk_saves`, before the forward
  pass: before the disk reads and the `offload_out` that reuse its offload block).
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
  computes the rest. A bad file is never served. A decode pool's hand-offs read the
  same way (`start_read`, `read_over`), through `handoff_tier.HandoffTier`.
- Retention (`retain`, issue 45's `kv_retention_s`): a finished request's blocks in the
  host tier are retained like the device pool's (`BlockPool.retain`), and a retained
  block the host tier lets go goes to disk with its deadline (`DiskBlock.retain_until`);
  one the disk holds already is saved again only to extend its deadline there (the
  worker then writes nothing, `disk_offload.py`). Its blocks that only the disk holds
  (the host tier let them go while it ran) get the deadline with the pool's next plan
  (`disk_retains`: the worker renames their files).
Pure Python.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence

from common.kv_events import KvCacheEvent
from common.step_plan import DiskBlock, DiskRetain
from common.step_result import StepResult
from services.scheduler.block_events import BlockLink, RopeKeyOf, no_rope_key
from services.scheduler.block_pool import BlockPool, Cached
from services.scheduler.handoff_tier import HandoffTier
from services.scheduler.kv_offload_events import TierEvents
from services.scheduler.request import Request
from services.scheduler.step_plan import PoolStepPlan

WAIT = None  # `hits_for`: the request waits for blocks being read from disk


class HostOffload:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        disk_hashes: Iterable[bytes] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`disk_hashes`: the blocks the worker's disk tier holds (None: it has none);
        `clock`: wall-clock seconds, for retention deadlines."""
        self.pool = BlockPool(num_blocks, enable_caching=True, record_events=True, clock=clock)
        self.block_size = block_size
        # The disk tier's blocks: hash -> what it held in the host tier (None: reported by
        # the worker at start, its place in a chain unknown).
        self.disk: dict[bytes, Cached | None] | None = (
            None if disk_hashes is None else dict.fromkeys(disk_hashes)
        )
        self._roots: dict[int, bytes] = {}  # offload block -> its chain's salted root
        self._disk_until: dict[bytes, float] = {}  # deadlines sent with disk saves
        self._disk_retains: list[DiskRetain] = []  # deadlines for the next plan (`retain`)
        # request -> its offload blocks, in chain order (a dict: a set that keeps order)
        self._held: dict[str, dict[int, None]] = {}
        self.events = TierEvents(block_size)
        self._saved_now: set[int] = set()  # offload blocks this plan writes into
        # Disk reads under way (a request's): hash -> (offload block held for it, its entry).
        self._loading: dict[bytes, tuple[int, Cached]] = {}
        self.num_saved_blocks = 0
        self.num_loaded_blocks = 0
        self.num_hit_tokens = 0
        self.num_query_tokens = 0
        self.num_disk_saved_blocks = 0
        self.num_disk_loaded_blocks = 0
        self.num_disk_failed_blocks = 0
        self.load_seconds = 0.0  # offload blocks into the pool (the worker's copies)
        self.disk_read_seconds = 0.0
        self.handoff = HandoffTier(self)  # a decode pool's loads and saves at hand-offs

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached

    @property
    def num_disk_blocks(self) -> int:
        return 0 if self.disk is None else len(self.disk)

    def begin_plan(self, plan: PoolStepPlan) -> None:
        """A plan starts; the disk deadlines `retain` moved since go in it."""
        self._saved_now.clear()
        if self._disk_retains:
            plan.disk_retains.extend(self._disk_retains)
            self._disk_retains.clear()

    # -- saving ------------------------------------------------------------------------------
    def saves(
        self,
        cached: Sequence[tuple[int, Hashable, Sequence[int]]],
        root: bytes,
        device: BlockPool,
        request_id: str,
    ) -> tuple[list[tuple[int, int]], list[DiskBlock]]:
        """(device block, offload block) copies for blocks newly cached on the device pool
        `device` (`(block, key, tokens)` of request `request_id`'s chain from `root`; each
        keeps its link), and the disk writes of the blocks they push out of the host tier;
        a block the tier holds already is only held for the request."""
        pairs, disk_saves = [], []
        for device_block, key, tokens in cached:
            found = self.pool.lookup(key, tokens)
            if found is not None:
                self._hold(request_id, [found])
                continue
            if not self.pool.num_free:
                break  # every offload block is held (by requests, or for disk reads)
            evicted, until = self.pool.next_evicted(), self.pool.next_evicted_until()
            (block,) = self.pool.allocate(1)  # evicts the LRU one
            if block in self._saved_now:  # written by this step (its request left since)
                self.pool.decref([block])
                break
            demoted = self._demote(block, evicted, until)
            if demoted is not None:
                disk_saves.append(demoted)
            self.pool.cache(block, key, tokens, device.blocks[device_block].link)
            self._held.setdefault(request_id, {})[block] = None  # (allocated: held once)
            self._roots[block] = root
            self._saved_now.add(block)
            pairs.append((device_block, block))
        self.num_saved_blocks += len(pairs)
        return pairs, disk_saves

    def _demote(
        self, block: int, evicted: Cached | None, until: float, in_plan: bool = True
    ) -> DiskBlock | None:
        """The disk write of what `block` held (retained until `until`), when the host
        tier just let it go; on disk already, only a later deadline is sent. `in_plan`:
        the write goes into the plan being made (not: into the next one, made between
        plans, when every copy planned so far has run before it)."""
        root = self._roots.pop(block, None)
        if evicted is None or self.disk is None or root is None:
            return None
        if in_plan and block in self._saved_now:
            return None  # its bytes land only after this step's forward pass
        until = until if until > self.pool.clock() else 0.0
        key = evicted.key
        if key in self.disk:
            if until <= self._disk_until.get(key, 0.0):
                return None
        else:
            self.num_disk_saved_blocks += 1
            self.disk[key] = evicted
            self.events.disk_stored(evicted)
        if until:
            self._disk_until[key] = until
        return DiskBlock(key, root, block, until)

    # -- hits ---------------------------------------------------------------------------------
    def hits_for(
        self, request: Request, num_device_hits: int
    ) -> tuple[list[int], list[DiskBlock], list[DiskBlock]] | None:
        """For a request that starts from scratch (block hashes current): the offload
        blocks holding its next blocks after its `num_device_hits` device prefix hits,
        the disk reads of the blocks after those that the disk tier holds (the request
        waits for them), and the disk writes of what their offload blocks held; WAIT while
        some are still being read. Nothing for a
        request that asks for prompt logprobs (every position is computed)."""
        if request.num_computed_tokens or request.sampling.prompt_logprobs is not None:
            return [], [], []
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
        self._hold(request.request_id, found)
        reads, writes = [], []
        while index < end and self.disk is not None:
            key = keys[index]
            if self.reading(key):
                return WAIT
            if key not in self.disk or not self.pool.num_free:
                break
            block, read = self.start_read(request, index, writes)
            self._loading[key] = (block, read)
            reads.append(DiskBlock(key, request.hash_root, block))
            index += 1
        return found, reads, writes

    def reading(self, key: bytes) -> bool:
        """A disk read of the block is under way (a request's, or a hand-off's)."""
        return key in self._loading or self.handoff.reading(key)

    def start_read(
        self, request: Request, index: int, writes: list[DiskBlock], in_plan: bool = True
    ) -> tuple[int, Cached]:
        """An offload block for a disk read of the request's block `index` (which the disk
        tier holds), held until the read is over, and what the block will be once read; the
        disk write of what the offload block held goes to `writes` (disk writes run before
        disk reads, both before the forward pass). `in_plan`: as `_demote`'s."""
        keys, bs = request.block_hashes, self.block_size
        evicted, until = self.pool.next_evicted(), self.pool.next_evicted_until()
        (block,) = self.pool.allocate(1)
        demoted = self._demote(block, evicted, until, in_plan)
        if demoted is not None:
            writes.append(demoted)
        link = BlockLink(keys[index - 1] if index else None, request.chain_origin)
        tokens = tuple(request.all_token_ids[index * bs : (index + 1) * bs])
        self._roots[block] = request.hash_root
        return block, Cached(keys[index], tokens, link)

    def read_over(self, block: int, read: Cached, ok: bool, holder: str | None = None) -> None:
        """A disk read into offload block `block` is over. Loaded (`ok`), the block joins
        the host tier: held for request `holder`, else free (newest, out last); failed,
        the block is free and the disk index forgets the block."""
        if ok:
            self.pool.cache(block, read.key, read.token_ids, read.link)
            if holder is None:
                self.pool.decref([block])
            else:  # (allocated: held once)
                self._held.setdefault(holder, {})[block] = None
            self.num_disk_loaded_blocks += 1
            return
        self._roots.pop(block, None)
        self.pool.decref([block])
        self._forget_on_disk(read.key)
        self.num_disk_failed_blocks += 1

    def unread(self, block: int) -> None:
        """A disk read into `block` is called off before any plan carried it."""
        self._roots.pop(block, None)
        self.pool.decref([block])

    def loaded(self, num_blocks: int, hit_tokens: bool = True) -> None:
        """A request admitted with `num_blocks` loaded from the host tier (counters; a
        decode pool's loads at a hand-off are no prefix-cache query's hits)."""
        self.num_loaded_blocks += num_blocks
        if hit_tokens:
            self.num_hit_tokens += num_blocks * self.block_size

    def record(self, result: StepResult) -> None:
        """What a step's result says of the tiers: disk reads done, blocks the disk let
        go, and the time loads took."""
        self.load_seconds += result.offload_load_seconds
        self.disk_read_seconds += result.disk_read_seconds
        if result.disk_loaded or result.disk_failed or result.disk_removed:
            self.disk_results(result.disk_loaded, result.disk_failed, result.disk_removed)

    def disk_results(
        self, loaded: Iterable[bytes], failed: Iterable[bytes], removed: Iterable[bytes]
    ) -> None:
        """A step's disk reads are done (loaded blocks join the host tier, newest first
        out last; failed ones leave the disk index), and blocks the disk tier let go."""
        loaded, failed = self.handoff.disk_results(loaded, failed)  # a hand-off's reads
        for key in loaded:
            self.read_over(*self._loading.pop(key), ok=True)
        for key in failed:
            self.read_over(*self._loading.pop(key), ok=False)
        for key in removed:
            if not self.reading(key):
                self._forget_on_disk(key)

    def _forget_on_disk(self, key: bytes) -> None:
        self._disk_until.pop(key, None)
        if self.disk is not None and key in self.disk:
            del self.disk[key]
            self.events.disk_removed(key)

    def take_kv_events(self, rope_key_of: RopeKeyOf = no_rope_key) -> list[KvCacheEvent]:
        """The tiers' KV events since the last take (medium CPU and Disk)."""
        return self.events.take(self.pool, self.disk, rope_key_of)

    def kv_snapshot(self, rope_key_of: RopeKeyOf = no_rope_key) -> list[KvCacheEvent]:
        """What the tiers hold now, as `BlockStored` events."""
        return self.events.snapshot(self.pool, self.disk, rope_key_of)

    def _hold(self, request_id: str, blocks: Sequence[int]) -> None:
        """The request holds these offload blocks (once each) until `release`."""
        held = self._held.setdefault(request_id, {})
        fresh = [b for b in blocks if b not in held]
        self.pool.touch(fresh)
        held.update(dict.fromkeys(fresh))

    def hold(self, request_id: str, blocks: Sequence[int]) -> None:
        """The request holds these offload blocks until `release` (a hand-off's loads)."""
        self._hold(request_id, blocks)

    def retain(self, request: Request, until: float) -> int:
        """Keep the finished request's blocks until wall-clock `until`: in the host tier
        those it holds and its other full computed blocks the tier has (a device prefix
        hit's); on disk those only the disk holds (the next plan's `disk_retains`). Call
        before `release`. Returns how many deadlines moved."""
        held = self._held.get(request.request_id, {})
        moved = self.pool.retain(held, until)
        keys, tokens, bs = request.block_hashes, request.all_token_ids, self.block_size
        for index in range(min(len(keys), request.num_computed_tokens // bs)):
            block = self.pool.lookup(keys[index], tokens[index * bs : (index + 1) * bs])
            if block is None:
                moved += self._retain_on_disk(keys[index], until)
            elif block not in held:
                moved += self.pool.retain([block], until)
        return moved

    def _retain_on_disk(self, key: bytes, until: float) -> int:
        """A block the host tier no longer holds: if the disk does, its deadline there
        moves with the next plan (a later one only; its file is renamed, not rewritten)."""
        if self.disk is None or key not in self.disk or until <= self._disk_until.get(key, 0.0):
            return 0
        self._disk_until[key] = until
        self._disk_retains.append(DiskRetain(key, until))
        return 1

    def release(self, request_id: str) -> None:
        """The request left the pool (finished, preempted, handed on): its offload blocks
        go back to the LRU queue tail first, so its chain's head is evicted last (a chain
        is useless past its first missing block)."""
        self.pool.decref(reversed(self._held.pop(request_id, {})))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs = Counter(b for blocks in self._held.values() for b in blocks)
        refs.update(block for block, _ in self._loading.values())
        refs.update(self.handoff.read_blocks())
        for block in range(self.pool.num_blocks):
            if self.pool.ref_count(block) != refs[block]:
                raise AssertionError(f"offload block {block} is held outside a request or read")
