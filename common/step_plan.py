"""The plan of one step, in the one shape it keeps from the scheduler's `PoolScheduler` to
the worker's persistent batch: the pool scheduler makes each request's `NewRequestData` or
`CachedRequestData` as it schedules it, the plan goes over the wire (`step_plan_pb.py`,
the only other form it takes) and the worker applies the same objects. Pure Python."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.parallel_plan import Layout
from common.sampling import SamplingParams
from common.structured_output import Constraint

if TYPE_CHECKING:
    from common.kv_shared_memory import SharedMemoryInfo


@dataclass(frozen=True)
class NewRequestData:
    """A request the worker holds nothing for: all its data."""

    request_id: str
    token_ids: Sequence[int]
    block_ids: Sequence[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    # Resolved, with the request's stop tokens (the ones min_tokens holds back).
    sampling: SamplingParams
    num_prompt_tokens: int = 0
    # Slots after the new tokens for proposals the worker verifies (speculative decoding).
    num_lookahead_tokens: int = 0
    lora_name: str = ""  # "" = the base model
    structured: Constraint | None = None
    # W3C trace context of the scheduler's span for the request ("": not traced).
    traceparent: str = ""
    tracestate: str = ""


@dataclass(frozen=True)
class CachedRequestData:
    """A request the worker already holds: what this step adds."""

    request_id: str
    new_block_ids: Sequence[int]
    num_scheduled_tokens: int
    # Whole replacement table (copy-on-write or a sliding window replaced blocks); empty =
    # append new_block_ids.
    block_table: Sequence[int] = ()
    num_lookahead_tokens: int = 0


@dataclass(frozen=True)
class DiskBlock:
    """A block of the disk tier (its chained hash, its chain's salted root) and the offload
    block it moves from or to; a save's `retain_until`: the wall-clock deadline the disk
    keeps it to (0: none; `common.retention`)."""

    block_hash: bytes
    root: bytes
    offload_block: int
    retain_until: float = 0.0


@dataclass(frozen=True)
class DiskRetain:
    """A block the disk tier holds whose deadline moves to `retain_until` (wall-clock
    seconds; `common.retention`): a finished retained request's block that the host tier no
    longer holds. Only its file's name changes; a block the disk no longer has is left
    alone (nothing is written)."""

    block_hash: bytes
    retain_until: float


@dataclass(frozen=True)
class BlockMoves:
    """Whole-block copies a step makes before its forward pass, in field order, and the
    offload tier's saves after it."""

    swap_out: Sequence[tuple[int, int]] = ()  # (device block, swap block)
    swap_in: Sequence[tuple[int, int]] = ()  # (swap block, device block)
    offload_in: Sequence[tuple[int, int]] = ()  # (offload block, device block)
    copies: Sequence[tuple[int, int]] = ()  # (shared device block, fresh device block)
    offload_out: Sequence[tuple[int, int]] = ()  # after the forward: (device, offload block)
    disk_saves: Sequence[DiskBlock] = ()  # before disk_loads (both before the forward)
    disk_loads: Sequence[DiskBlock] = ()  # into held offload blocks, before the forward
    disk_retains: Sequence[DiskRetain] = ()  # deadlines only, before disk_saves

    def __bool__(self) -> bool:
        return bool(
            self.swap_out
            or self.swap_in
            or self.offload_in
            or self.copies
            or self.offload_out
            or self.disk_saves
            or self.disk_loads
            or self.disk_retains
        )


@dataclass(frozen=True)
class KvSource:
    """The blocks a same-host pull copies out of a peer's shared pools (one per rank of its
    `layout`, rank 0's first: its progress header speaks for all), final once the peer has
    run step `ready_step_id` (0: final already)."""

    worker_id: str
    rank_pools: Sequence[SharedMemoryInfo]
    block_ids: Sequence[int]
    ready_step_id: int = 0
    layout: Layout = Layout()


@dataclass(frozen=True)
class KvLoad:
    """KV from a peer into blocks of this pool (the peers' connector metadata): pulled out
    of its shared pool (`source`), else one UCX message with this tag from a sender of
    layout `sender_layout` (which a `SendKv` on it sends). Written only after the steps
    planned before it have run, never once its tag is cancelled."""

    tag: int
    block_ids: Sequence[int]
    source: KvSource | None = None
    sender_layout: Layout = Layout()
    # W3C trace context of the scheduler's transfer span ("": not traced).
    traceparent: str = ""
    tracestate: str = ""


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    # Requests the worker drops from its persistent batch before running.
    finished_ids: Sequence[str]
    new: Sequence[NewRequestData]
    cached: Sequence[CachedRequestData]
    moves: BlockMoves
    # Tags of KV receives given up on: from this step on none may write into the pool.
    cancelled_transfer_tags: Sequence[int] = ()
    # KV loads from peers, started when the plan arrives (each reported once, with the
    # first result after it ends: `StepResult.kv_loads_done`).
    kv_loads: Sequence[KvLoad] = ()
    # No tokens scheduled: answered once a load ends or the next plan arrives.
    await_kv: bool = False
