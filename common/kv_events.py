"""KV cache events in vLLM's format (`vllm/distributed/kv_events.py`): what a scheduler's
prefix caches gained and lost, for a router that wants to know what each scheduler really
holds. Pure Python: the shapes, shared by the scheduler that publishes them and the gateway
that consumes them (`kv_events_pb.py` turns them into protobuf and back).

- `BlockStored`: full blocks became cached, consecutive in one sequence: `block_hashes[i]`
  holds `token_ids[i * block_size : (i + 1) * block_size]`, its parent is the block before
  it (`parent_block_hash` for the first; None when the first is a sequence's first block).
- `BlockRemoved`: cached blocks were dropped (evicted to make room, or reset).
- `AllBlocksCleared`: every cached block of the medium (every medium: "") is gone.
- `KvEventBatch`: the events of one pool that happened together, in order, numbered.

Every event names its `medium`, the tier that holds (or held) the blocks: vLLM's names,
`GPU` for the pool the model reads (whatever the device: vLLM's CPU backend says `GPU` too),
`CPU` for host memory and `Disk` for a disk tier behind it.

Hashes are the scheduler's own (salted per deployment: a consumer cannot compute them), so a
consumer rebuilds its own chain from the tokens and the parent, as Dynamo's router does. A
sequence's first block has no parent: what the scheduler's root mixes besides its salt then
rides along as Tandem extensions to vLLM's `BlockStored`, `cache_salt` and `rope_key`
(`lora_name` is vLLM's own field, on every `BlockStored`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.prefix_hash import BlockHash

MEDIUM_GPU = "GPU"  # the worker's KV pool, the one its model reads
MEDIUM_CPU = "CPU"  # a host-memory tier (offload)
MEDIUM_DISK = "Disk"  # a disk tier behind it
MEDIUMS = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str = ""
    medium: str = MEDIUM_GPU
    # Tandem extensions, set on a sequence's first block (no parent): what the root of its
    # chain mixes besides the scheduler's salt (`common.prefix_hash.root_hash`).
    cache_salt: str = ""
    rope_key: str = ""

    def __post_init__(self) -> None:
        if not self.block_hashes or self.block_size <= 0:
            raise ValueError("BlockStored needs blocks and a positive block_size")
        if len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(
                f"BlockStored: {len(self.token_ids)} tokens for {len(self.block_hashes)} "
                f"blocks of {self.block_size}"
            )

    def block_tokens(self, index: int) -> tuple[int, ...]:
        """The tokens block `index` of this event holds."""
        size = self.block_size
        return self.token_ids[index * size : (index + 1) * size]


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True)
class AllBlocksCleared:
    medium: str = ""  # "": every medium (vLLM's event has no fields: that)


KvCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KvEventBatch:
    """One pool's events in order. `seq` numbers the published batches of a scheduler
    1, 2, 3... with no gap, so a subscriber that misses one knows; the batches of the
    snapshot a subscriber gets first (`snapshot`) all carry the `seq` of the last batch
    they include, and the last of them says `snapshot_done`. `worker_id` and `role` name
    the pool (vLLM's `data_parallel_rank` in spirit)."""

    seq: int
    ts: float
    worker_id: str
    role: str
    events: tuple[KvCacheEvent, ...]
    snapshot: bool = False
    snapshot_done: bool = False

    @property
    def runs_prompts(self) -> bool:
        """A prefix cache a prompt can hit (a decode pool's only saves a transfer)."""
        return self.role in ("prefill", "both")


def merge_events(events: list[KvCacheEvent]) -> list[KvCacheEvent]:
    """Consecutive events joined where vLLM's would be: a `BlockStored` continuing the
    previous one's sequence (same medium, adapter and block size) extends it, and removals
    in a row from one medium make one `BlockRemoved`. Linear in the blocks."""
    out: list[KvCacheEvent] = []
    hashes: list[BlockHash] = []  # the blocks and tokens joined onto out[-1] so far
    tokens: list[int] = []

    def close() -> None:
        if not hashes:
            return
        last = out[-1]
        if isinstance(last, BlockStored):
            out[-1] = replace(
                last,
                block_hashes=last.block_hashes + tuple(hashes),
                token_ids=last.token_ids + tuple(tokens),
            )
        else:
            out[-1] = replace(last, block_hashes=last.block_hashes + tuple(hashes))
        hashes.clear()
        tokens.clear()

    for event in events:
        last = out[-1] if out else None
        tail = hashes[-1] if hashes else None
        if (
            isinstance(event, BlockStored)
            and isinstance(last, BlockStored)
            and event.parent_block_hash is not None
            and event.parent_block_hash == (tail or last.block_hashes[-1])
            and (event.medium, event.lora_name, event.block_size)
            == (last.medium, last.lora_name, last.block_size)
        ):
            hashes.extend(event.block_hashes)
            tokens.extend(event.token_ids)
        elif (
            isinstance(event, BlockRemoved)
            and isinstance(last, BlockRemoved)
            and event.medium == last.medium
        ):
            hashes.extend(event.block_hashes)
        else:
            close()
            out.append(event)
    close()
    return out


def num_blocks(event: KvCacheEvent) -> int:
    return 0 if isinstance(event, AllBlocksCleared) else len(event.block_hashes)


def _pieces(event: KvCacheEvent, size: int) -> list[KvCacheEvent]:
    """`event` cut into events of at most `size` blocks (a BlockStored's later pieces name
    the previous piece's last block as their parent, and carry no first-block fields)."""
    if num_blocks(event) <= size:
        return [event]
    if isinstance(event, BlockRemoved):
        hashes = event.block_hashes
        return [
            replace(event, block_hashes=hashes[i : i + size]) for i in range(0, len(hashes), size)
        ]
    assert isinstance(event, BlockStored)
    pieces: list[KvCacheEvent] = []
    tokens = size * event.block_size
    for i in range(0, len(event.block_hashes), size):
        first = i == 0
        pieces.append(
            replace(
                event,
                block_hashes=event.block_hashes[i : i + size],
                parent_block_hash=event.parent_block_hash if first else event.block_hashes[i - 1],
                token_ids=event.token_ids[i // size * tokens : (i // size + 1) * tokens],
                cache_salt=event.cache_salt if first else "",
                rope_key=event.rope_key if first else "",
            )
        )
    return pieces


def chunk_events(events: list[KvCacheEvent], max_blocks: int) -> list[list[KvCacheEvent]]:
    """`events` in order, cut into lists of at most `max_blocks` blocks each (an event
    larger than that is cut too): one list per published batch, none empty."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    out: list[list[KvCacheEvent]] = []
    current: list[KvCacheEvent] = []
    count = 0
    for event in events:
        for piece in _pieces(event, max_blocks):
            blocks = num_blocks(piece)
            if current and count + blocks > max_blocks:
                out.append(current)
                current, count = [], 0
            current.append(piece)
            count += blocks
    if current:
        out.append(current)
    return out
