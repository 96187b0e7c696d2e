"""A block pool's index events as vLLM's KV events (`common/kv_events.py`): which blocks a
block manager publishes, and what it says of each. Pure Python.

- One KV group speaks for a logical block: in a hybrid pool (keys `(hash, group)`) the
  first full-attention group (group 0 when every group is windowed). A prefix hit needs
  every full group's blocks, which are cached and freed together, so that group's blocks
  say where a hit can be; a windowed group's older blocks may be gone earlier (trimmed,
  then evicted first), so a router reading these events may count a few blocks more than
  the scheduler then finds: a hint, never a wrong answer (the scheduler checks tokens).
- A cached block carries a `BlockLink`: its parent's hash (None for a sequence's first
  block) and its request's `ChainOrigin`, so that `BlockStored` names the parent and, on a
  first block, the extensions a consumer needs to rebuild the chain's root.
- A snapshot (what a late subscriber learns first) is every cached block of that group,
  parents before children, as the `BlockStored` events that would have announced them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from common.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    merge_events,
)
from common.prefix_hash import BlockHash, ChainOrigin
from services.scheduler.block_pool import Cached, Cleared, Lost, PoolEvent, Uncached

RopeKeyOf = Callable[[int], str]  # a prompt's length -> its RoPE key ("" for most models)


def no_rope_key(num_prompt_tokens: int) -> str:
    return ""


@dataclass(frozen=True, slots=True)
class BlockLink:
    """Where a cached block sits in its sequence's chain."""

    parent: BlockHash | None
    origin: ChainOrigin | None


def event_group(group_windows: tuple[int | None, ...]) -> int:
    """The KV group whose blocks a hybrid pool publishes (module docstring)."""
    return next((g for g, window in enumerate(group_windows) if window is None), 0)


@dataclass(frozen=True)
class BlockEvents:
    """How one block manager's pool events read: its block size, its number of groups and
    the one it publishes, and the medium its pool is."""

    block_size: int
    num_groups: int = 1
    group: int = 0
    medium: str = MEDIUM_GPU

    def hash_of(self, key: Hashable) -> BlockHash | None:
        """The block hash a pool key publishes (None: another group's block)."""
        if self.num_groups == 1:
            return key  # type: ignore[return-value]
        block_hash, group = key  # type: ignore[misc]
        return block_hash if group == self.group else None

    def stored(self, block_hash: BlockHash, cached: Cached, rope_key_of: RopeKeyOf) -> BlockStored:
        link = cached.link
        assert isinstance(link, BlockLink)  # (callers pass linked blocks only)
        origin = link.origin or ChainOrigin()
        first = link.parent is None
        return BlockStored(
            block_hashes=(block_hash,),
            parent_block_hash=link.parent,
            token_ids=cached.token_ids,
            block_size=self.block_size,
            lora_name=origin.lora_name,
            medium=self.medium,
            cache_salt=origin.cache_salt if first else "",
            rope_key=rope_key_of(origin.num_prompt_tokens) if first else "",
        )

    def convert(
        self, events: Iterable[PoolEvent], rope_key_of: RopeKeyOf = no_rope_key
    ) -> list[KvCacheEvent]:
        """The pool's events as KV events, runs joined (`merge_events`)."""
        out: list[KvCacheEvent] = []
        for event in events:
            if isinstance(event, Cleared):
                out.append(AllBlocksCleared(self.medium))
                continue
            if isinstance(event, Lost):
                raise ValueError("lost events: read the cache instead (take_kv_events)")
            block_hash = self.hash_of(event.key)
            if block_hash is None:
                continue
            if isinstance(event, Cached):
                if isinstance(event.link, BlockLink):  # (unlinked: no place in a chain)
                    out.append(self.stored(block_hash, event, rope_key_of))
            elif isinstance(event, Uncached):
                out.append(BlockRemoved((block_hash,), self.medium))
        return merge_events(out)

    def snapshot(
        self, cached: Iterable[Cached], rope_key_of: RopeKeyOf = no_rope_key
    ) -> list[KvCacheEvent]:
        """`BlockStored` for every block of the published group in `cached`, each after
        its parent when that is cached too (a block cached with no link, by a manager that
        recorded no events, has no known place in a chain: left out)."""
        entries: dict[BlockHash, Cached] = {}
        for entry in cached:
            block_hash = self.hash_of(entry.key)
            if block_hash is not None and isinstance(entry.link, BlockLink):
                entries[block_hash] = entry
        ordered: list[KvCacheEvent] = []
        done: set[BlockHash] = set()
        for block_hash in entries:
            chain = []  # this block and its ancestors not yet sent, child first
            current: BlockHash | None = block_hash
            while current is not None and current in entries and current not in done:
                done.add(current)
                chain.append(current)
                current = entries[current].link.parent  # type: ignore[union-attr]
            for h in reversed(chain):
                ordered.append(self.stored(h, entries[h], rope_key_of))
        return merge_events(ordered)
