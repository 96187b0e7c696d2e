"""A decode pool's offload tier at the hand-off: a decode worker keeps a conversation's KV
(`--kv-offload-cpu-bytes` on a decode worker) and serves its next turn from it.

- **Saves.** The blocks a decode pool caches are written through to its host tier: the
  ones its decode steps fill (the pool's own saves), and the ones a hand-off brought
  (`save_arrival`, saved after the forward pass of the pool's next step).
- **Loads.** When a hand-off picks a decode pool, the blocks after its device prefix hits
  that its host tier holds, in a run (`hits`), are not transferred: they are held for the
  request (`hold`) and copied from the tier into its fresh decode blocks before the
  forward pass of the pool's next step (`offload_in`), which comes before any step the
  request runs in. Only the rest moves from the prefill worker.
- A transfer given up before that step (`drop`) takes its loads back and lets go of the
  tier blocks it held.

`take` puts what waits into the pool's next plan, after the tier's `begin_plan`. Pure
Python; the tier is the pool's `kv_offload.HostOffload`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from services.scheduler.block_pool import BlockPool
from services.scheduler.request import Request
from services.scheduler.step_plan import PoolStepPlan

Cached = list[tuple[int, Hashable, Sequence[int]]]  # (device block, key, tokens)


class Tier(Protocol):
    """What of `kv_offload.HostOffload` this uses (it owns a `HandoffTier`)."""

    pool: BlockPool
    block_size: int

    def hold(self, request_id: str, blocks: Sequence[int]) -> None: ...
    def release(self, request_id: str) -> None: ...
    def loaded(self, num_blocks: int, hit_tokens: bool = True) -> None: ...
    def saves(self, cached: Cached, root: bytes, device: BlockPool, request_id: str): ...


class HandoffTier:
    def __init__(self, offload: Tier) -> None:
        self.offload = offload
        self._loads: dict[str, list[tuple[int, int]]] = {}  # request -> (offload, device)
        # Arrivals' newly cached decode blocks: (request, [(block, key, tokens)], root).
        self._saves: list[tuple[str, Cached, bytes]] = []

    def hits(self, request: Request, num_device_hits: int, num_tokens: int) -> list[int]:
        """The tier's blocks holding the request's blocks after its `num_device_hits`
        device hits, in a run, among the full blocks of its first `num_tokens` tokens (not
        held: `hold` them once the pool is chosen)."""
        if request.sampling.prompt_logprobs is not None:
            return []
        keys, tokens, bs = request.block_hashes, request.all_token_ids, self.offload.block_size
        found, index = [], num_device_hits
        end = min(len(keys), num_tokens // bs)
        while index < end:
            block = self.offload.pool.lookup(keys[index], tokens[index * bs : (index + 1) * bs])
            if block is None:
                break
            found.append(block)
            index += 1
        return found

    def hold(self, request_id: str, tier_blocks: Sequence[int], device_blocks: Sequence[int]):
        """Load `tier_blocks` into the request's `device_blocks` with the pool's next step;
        held for it until it leaves the pool (or `drop`)."""
        if not tier_blocks:
            return
        self.offload.hold(request_id, tier_blocks)
        self._loads[request_id] = list(zip(tier_blocks, device_blocks, strict=True))

    def drop(self, request_id: str) -> None:
        """The request's transfer was given up before it reached the pool: no load (if
        not planned yet), no hold."""
        self._loads.pop(request_id, None)
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
        for request_id, cached, root in self._saves:
            pairs, disk_saves = self.offload.saves(cached, root, device, request_id)
            plan.offload_out.extend(pairs)
            plan.disk_saves.extend(disk_saves)
        self._saves.clear()
