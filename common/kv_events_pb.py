"""KV events (`common/kv_events.py`) as the `KvEventBatch` protobuf of the scheduler's
`KvEvents` stream, and back. A message that breaks the shapes' rules (tokens that do not
fill its blocks, an empty block list) raises ValueError on the way in."""

from __future__ import annotations

from common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    KvEventBatch,
)
from common.pb.tandem.internal.v1 import scheduler_pb2
from common.sampling_pb import ROLE_FROM_PB, ROLE_TO_PB


def event_to_pb(event: KvCacheEvent) -> scheduler_pb2.KvCacheEvent:
    if isinstance(event, BlockStored):
        stored = scheduler_pb2.BlockStored(
            block_hashes=event.block_hashes,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_name=event.lora_name,
            medium=event.medium,
            cache_salt=event.cache_salt,
            rope_key=event.rope_key,
        )
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        return scheduler_pb2.KvCacheEvent(block_stored=stored)
    if isinstance(event, BlockRemoved):
        removed = scheduler_pb2.BlockRemoved(block_hashes=event.block_hashes, medium=event.medium)
        return scheduler_pb2.KvCacheEvent(block_removed=removed)
    cleared = scheduler_pb2.AllBlocksCleared(medium=event.medium)
    return scheduler_pb2.KvCacheEvent(all_blocks_cleared=cleared)


def event_from_pb(message: scheduler_pb2.KvCacheEvent) -> KvCacheEvent:
    kind = message.WhichOneof("event")
    if kind == "block_stored":
        s = message.block_stored
        return BlockStored(
            block_hashes=tuple(s.block_hashes),
            parent_block_hash=s.parent_block_hash if s.HasField("parent_block_hash") else None,
            token_ids=tuple(s.token_ids),
            block_size=s.block_size,
            lora_name=s.lora_name,
            medium=s.medium,
            cache_salt=s.cache_salt,
            rope_key=s.rope_key,
        )
    if kind == "block_removed":
        r = message.block_removed
        return BlockRemoved(tuple(r.block_hashes), r.medium)
    if kind == "all_blocks_cleared":
        return AllBlocksCleared(message.all_blocks_cleared.medium)
    raise ValueError("a KvCacheEvent without an event")


def batch_to_pb(batch: KvEventBatch) -> scheduler_pb2.KvEventBatch:
    return scheduler_pb2.KvEventBatch(
        seq=batch.seq,
        ts=batch.ts,
        worker_id=batch.worker_id,
        role=ROLE_TO_PB.get(batch.role, 0),
        events=[event_to_pb(e) for e in batch.events],
        snapshot=batch.snapshot,
        snapshot_done=batch.snapshot_done,
    )


def batch_from_pb(message: scheduler_pb2.KvEventBatch) -> KvEventBatch:
    return KvEventBatch(
        seq=message.seq,
        ts=message.ts,
        worker_id=message.worker_id,
        role=ROLE_FROM_PB.get(message.role, ""),
        events=tuple(event_from_pb(e) for e in message.events),
        snapshot=message.snapshot,
        snapshot_done=message.snapshot_done,
    )
