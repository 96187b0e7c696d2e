"""The host-memory KV offload tier of one pool, as its scheduler manages it: full blocks
the pool computes are also written to the worker's offload blocks (`--kv-offload-cpu-bytes`),
so a prefix the pool's prefix cache has evicted is loaded back instead of recomputed.

The tier is a second block pool with its own prefix-cache index (same keys, so
`cache_salt`, adapter and deployment isolation hold here too) and its own LRU: every
offload block is free and cached, the least recently saved or hit first out. The
scheduler decides every copy, so it always knows what the tier holds:
- `saves`: each block newly cached in the device pool and not yet in the tier gets an
  offload block (evicting the LRU one); the worker copies it there after the step's
  forward pass (`BlockMoves.offload_out`), when the block's KV is complete. Write-through:
  a block is saved while it is surely intact, and never on the path of the allocation
  that would evict it (see docs/architecture.md, *KV offload*).
- `hits`: the blocks after a request's device prefix hit that the tier holds, in a run;
  the worker copies them into the request's fresh device blocks before the forward pass
  (`BlockMoves.offload_in`), in the same step that computes the rest of the prompt. The
  loads run before that step's saves, so an offload block hit and reused in one step is
  read before it is overwritten.
Pure Python.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from services.scheduler.block_pool import BlockPool
from services.scheduler.request import Request


class HostOffload:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.block_size = block_size
        self.num_saved_blocks = 0
        self.num_loaded_blocks = 0
        self.num_hit_tokens = 0
        self.num_query_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached

    def saves(self, cached: Sequence[tuple[int, Hashable, Sequence[int]]]) -> list[tuple[int, int]]:
        """(device block, offload block) copies for blocks newly cached on the device
        (`(block, key, tokens)`); a block the tier holds already is only refreshed."""
        pairs = []
        for device_block, key, tokens in cached:
            held = self.pool.lookup(key, tokens)
            if held is not None:
                self._refresh(held)
                continue
            (block,) = self.pool.allocate(1)  # every block is free: evicts the LRU one
            self.pool.cache(block, key, tokens)
            self.pool.decref([block])  # free again, at the tail: the newest
            pairs.append((device_block, block))
        self.num_saved_blocks += len(pairs)
        return pairs

    def hits_for(self, request: Request, num_device_hits: int) -> list[int]:
        """Offload blocks holding a request's next blocks after its `num_device_hits`
        device prefix-cache hits, for one that starts from scratch (block hashes current;
        none for a request that asks for prompt logprobs: every position is computed)."""
        if request.num_computed_tokens or request.sampling.prompt_logprobs is not None:
            return []
        return self.hits(
            request.block_hashes,
            request.all_token_ids,
            num_device_hits,
            request.num_known_tokens - 1,
        )

    def hits(
        self,
        keys: Sequence[Hashable],
        token_ids: Sequence[int],
        first_block: int,
        max_tokens: int,
    ) -> list[int]:
        """Offload blocks holding the request's blocks `first_block`, `first_block + 1`, ...
        (a run, stopping at the first the tier lacks), within `max_tokens` tokens; each
        hit becomes the newest."""
        bs = self.block_size
        found = []
        for index in range(first_block, min(len(keys), max_tokens // bs)):
            block = self.pool.lookup(keys[index], token_ids[index * bs : (index + 1) * bs])
            if block is None:
                break
            found.append(block)
        for block in found:
            self._refresh(block)
        return found

    def loaded(self, num_blocks: int) -> None:
        """A request admitted with `num_blocks` loaded from the tier (counters)."""
        self.num_loaded_blocks += num_blocks
        self.num_hit_tokens += num_blocks * self.block_size

    def _refresh(self, block: int) -> None:
        self.pool.touch([block])
        self.pool.decref([block])

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        if self.pool.num_free != self.pool.num_blocks:
            raise AssertionError("an offload block is held outside a step")
