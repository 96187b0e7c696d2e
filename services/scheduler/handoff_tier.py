"""A decode pool's offload tiers at the hand-off: a decode worker keeps a conversation's KV
(`--kv-offload-cpu-bytes` on a decode worker, and `--kv-offload-dir` behind it) and serves
its next turn from it.

- **Saves.** The blocks a decode pool caches are written through to its host tier: the
  ones its decode steps fill (the pool's own saves), and the ones a hand-off brought
  (`save_arrival`, saved after the forward pass of the pool's next step). A block the host
  tier lets go is written to disk (write-on-evict, `kv_offload.HostOffload`).
- **Loads.** When a hand-off picks a decode pool, the blocks after its device prefix hits
  that its host tier holds, in a run, then the blocks after those that its disk tier
  holds (`hits`: a `TierRun`), are not transferred (`hold`):
  - the host tier's are held for the request and copied into its fresh decode blocks
    before the forward pass of the pool's next step (`offload_in`), which comes before
    any step the request runs in;
  - the disk's are read into offload blocks held for them with that step (`disk_loads`).
    Once its result says which loaded (`disk_results`), those are held for the request
    and copied into its decode blocks with the pool's next step, and the request's
    outcome is ready (`take_outcomes`: the places in its table of the blocks whose read
    failed, missing or bad on some rank). The hand-off moves those from the prefill
    worker too, and the request reaches the pool only then (`handoff.KvHandoff`).
  Only the rest moves from the prefill worker.
- A transfer given up (`drop`) takes its loads back and lets go of the tier blocks it
  held; its disk reads not yet planned are called off, and those under way end as
  anyone's (a block read joins the host tier, free).

`take` puts what waits into the pool's next plan, after the tier's `begin_plan`. Pure
Python; the tier is the pool's `kv_offload.HostOffload`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.step_plan import DiskBlock
from services.scheduler.block_pool import BlockPool
from services.scheduler.block_pool import Cached as Entry
from services.scheduler.request import Request
from services.scheduler.step_plan import PoolStepPlan

Cached = list[tuple[int, Hashable, Sequence[int]]]  # (device block, key, tokens)


class Tier(Protocol):
    """What of `kv_offload.HostOffload` this uses (it owns a `HandoffTier`)."""

    pool: BlockPool
    block_size: int
    disk: dict[bytes, object] | None

    def hold(self, request_id: str, blocks: Sequence[int]) -> None: ...
    def release(self, request_id: str) -> None: ...
    def loaded(self, num_blocks: int, hit_tokens: bool = True) -> None: ...
    def saves(self, cached: Cached, root: bytes, device: BlockPool, request_id: str): ...
    def reading(self, key: bytes) -> bool: ...
    def start_read(
        self, request: Request, index: int, writes: list[DiskBlock], in_plan: bool = True
    ): ...
    def read_over(self, block: int, read: Entry, ok: bool, holder: str | None = None): ...
    def unread(self, block: int) -> None: ...


@dataclass(frozen=True)
class TierRun:
    """What a decode pool's tiers hold of a request's blocks from block `start` on (its
    device hits end there), in a run: the host tier's blocks, then how many of the next
    blocks its disk tier holds."""

    start: int = 0
    host: tuple[int, ...] = ()
    num_disk: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.host) + self.num_disk


NO_RUN = TierRun()


@dataclass
class _Read:
    """A hand-off's disk read: its offload block, what that block holds once read, the
    request it is for (None: given up), the block's place in its table, its decode block."""

    block: int
    entry: Entry
    holder: str | None
    index: int
    device: int


@dataclass
class _Waiting:
    """A request's disk reads not over yet, and the places of those that failed."""

    left: int
    failed: list[int] = field(default_factory=list)


class HandoffTier:
    def __init__(self, offload: Tier) -> None:
        self.offload = offload
        self._loads: dict[str, list[tuple[int, int]]] = {}  # request -> (offload, device)
        # Arrivals' newly cached decode blocks: (request, [(block, key, tokens)], root).
        self._saves: list[tuple[str, Cached, bytes]] = []
        self._reads: dict[bytes, _Read] = {}  # block hash -> its read, until it is over
        self._unplanned: dict[str, list[DiskBlock]] = {}  # request -> reads for the next plan
        self._writes: list[DiskBlock] = []  # the disk writes of what their blocks held
        self._waiting: dict[str, _Waiting] = {}
        # request -> the places in its table of the blocks whose read failed, once its reads
        # are all over (`take_outcomes`).
        self.outcomes: dict[str, list[int]] = {}

    def hits(self, request: Request, num_device_hits: int, num_tokens: int) -> TierRun:
        """The run of the request's blocks after its `num_device_hits` device hits that the
        tiers hold, among the full blocks of its first `num_tokens` tokens: the host
        tier's, then the disk's (as many as offload blocks can be read into; none being
        read already). Nothing is held: `hold` it once the pool is chosen."""
        if request.sampling.prompt_logprobs is not None:
            return NO_RUN
        offload = self.offload
        keys, tokens, bs = request.block_hashes, request.all_token_ids, offload.block_size
        host, index = [], num_device_hits
        end = min(len(keys), num_tokens // bs)
        while index < end:
            block = offload.pool.lookup(keys[index], tokens[index * bs : (index + 1) * bs])
            if block is None:
                break
            host.append(block)
            index += 1
        num_disk = 0
        if offload.disk is not None and index < end:
            # Offload blocks free to read into once the host run is held.
            room = offload.pool.num_free - sum(1 for b in host if not offload.pool.ref_count(b))
            while index + num_disk < end and num_disk < room:
                key = keys[index + num_disk]
                if key not in offload.disk or offload.reading(key):
                    break
                num_disk += 1
        return TierRun(num_device_hits, tuple(host), num_disk)

    def hold(self, request: Request, run: TierRun, device_blocks: Sequence[int]) -> int:
        """The blocks of `run` come from the tiers into `device_blocks` (the request's
        fresh decode blocks, one per block of the run): the host tier's with the pool's
        next step; the disk's read with that step and loaded after it. Held for the
        request until it leaves the pool (or `drop`). Returns how many blocks of the run
        this covers (fewer disk reads than `run.num_disk` only if offload blocks ran
        short); when it covers any disk block, wait for `take_outcomes`."""
        rid, num_host = request.request_id, len(run.host)
        if run.host:
            self.offload.hold(rid, run.host)
            self._loads[rid] = list(zip(run.host, device_blocks[:num_host], strict=True))
        reads = []
        for i in range(run.num_disk):
            if not self.offload.pool.num_free:
                break
            index = run.start + num_host + i
            # (between plans: the write and the read go into the next one)
            block, entry = self.offload.start_read(request, index, self._writes, in_plan=False)
            self._reads[entry.key] = _Read(block, entry, rid, index, device_blocks[num_host + i])
            reads.append(DiskBlock(entry.key, request.hash_root, block))
        if reads:
            self._unplanned[rid] = reads
            self._waiting[rid] = _Waiting(len(reads))
        return num_host + len(reads)

    def reading(self, key: bytes) -> bool:
        """A hand-off's disk read of the block is under way (planned or not)."""
        return key in self._reads

    def read_blocks(self) -> Iterator[int]:
        """The offload blocks the hand-offs' disk reads hold (one reference each)."""
        return (read.block for read in self._reads.values())

    def disk_results(
        self, loaded: Iterable[bytes], failed: Iterable[bytes]
    ) -> tuple[list[bytes], list[bytes]]:
        """A step's disk reads are over. The hand-offs' are settled here: a block loaded is
        held for its request and copied into its decode block with the pool's next step;
        a request whose reads are all over has its outcome. Returns the other reads'
        (loaded, failed)."""
        others: tuple[list[bytes], list[bytes]] = ([], [])
        for ok, keys, rest in ((True, loaded, others[0]), (False, failed, others[1])):
            for key in keys:
                read = self._reads.pop(key, None)
                if read is None:
                    rest.append(key)
                    continue
                self.offload.read_over(read.block, read.entry, ok, read.holder)
                if read.holder is None:  # given up meanwhile
                    continue
                waiting = self._waiting[read.holder]
                if ok:
                    self._loads.setdefault(read.holder, []).append((read.block, read.device))
                else:
                    waiting.failed.append(read.index)
                waiting.left -= 1
                if not waiting.left:
                    del self._waiting[read.holder]
                    self.outcomes[read.holder] = sorted(waiting.failed)
        return others

    def take_outcomes(self) -> dict[str, list[int]]:
        """Requests whose disk reads are all over since the last call: request -> the
        places in its table of the blocks that failed (they must move)."""
        outcomes, self.outcomes = self.outcomes, {}
        return outcomes

    def drop(self, request_id: str) -> None:
        """The request's transfer was given up before it reached the pool: no load (if
        not planned yet), no disk read not planned yet, no hold."""
        self._loads.pop(request_id, None)
        self._waiting.pop(request_id, None)
        self.outcomes.pop(request_id, None)
        for disk_block in self._unplanned.pop(request_id, ()):
            self.offload.unread(self._reads.pop(disk_block.block_hash).block)
        for read in self._reads.values():  # under way: they end as anyone's
            if read.holder == request_id:
                read.holder = None
        self.offload.release(request_id)

    def save_arrival(self, request_id: str, cached: Cached, root: bytes) -> None:
        """Blocks the hand-off just cached in the decode pool: saved with its next step."""
        if cached:
            self._saves.append((request_id, cached, root))

    def take(self, plan: PoolStepPlan, device: BlockPool) -> None:
        """What waits, into the pool's next plan (called after the tier's `begin_plan`)."""
        for pairs in self._loads.values():
            plan.offload_in.extend(pairs)
            self.offload.loaded(len(pairs), hit_tokens=False)
        self._loads.clear()
        if self._unplanned or self._writes:  # the writes run first (their blocks are read into)
            plan.disk_saves.extend(self._writes)
            self._writes.clear()
            for reads in self._unplanned.values():
                plan.disk_loads.extend(reads)
            self._unplanned.clear()
        for request_id, cached, root in self._saves:
            pairs, disk_saves = self.offload.saves(cached, root, device, request_id)
            plan.offload_out.extend(pairs)
            plan.disk_saves.extend(disk_saves)
        self._saves.clear()
