"""A pool scheduler's step: the plan it makes (`PoolStepPlan`, what `PoolScheduler.schedule()`
returns: the worker's `common.step_plan` entries, made as each request is scheduled, with
the scheduler's own bookkeeping beside them) and what applying the step's result changed
(`StepUpdate`, what `PoolScheduler.update()` returns). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from common.step_plan import (
    BlockMoves,
    CachedRequestData,
    DiskBlock,
    DiskRetain,
    KvLoad,
    NewRequestData,
    StepPlan,
)
from services.scheduler.request import FinishReason, Logprob, Request


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    # What the worker gets for it: all its data when the worker holds nothing for it yet,
    # else what this step adds.
    work: NewRequestData | CachedRequestData
    # Tokens computed before this step (where its new tokens start).
    num_computed_before: int
    # The step reaches the request's last token and samples the next one.
    samples: bool = False

    @property
    def is_new(self) -> bool:
        return isinstance(self.work, NewRequestData)

    @property
    def num_new_tokens(self) -> int:
        return self.work.num_scheduled_tokens

    @property
    def new_block_ids(self) -> list[int]:
        """The blocks this step gives the worker: the whole table for a new request, else
        those appended (none when the table was replaced)."""
        work = self.work
        return list(work.block_ids if isinstance(work, NewRequestData) else work.new_block_ids)

    @property
    def replaced_table(self) -> list[int] | None:
        """The request's whole table when copy-on-write or a window replaced blocks."""
        work = self.work
        if isinstance(work, CachedRequestData) and work.block_table:
            return list(work.block_table)
        return None

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots (blocks allocated) after the new tokens for proposals the worker verifies
        in this step (speculative decoding); only when it samples."""
        return self.work.num_lookahead_tokens


def new_request_data(
    request: Request, table: list[int], start: int, num_new: int, lookahead: int
) -> NewRequestData:
    """All of a request's data for a worker that holds nothing for it: its tokens and block
    table, `num_new` tokens to compute from `start`, its sampling with its stop tokens (the
    ones min_tokens holds back)."""
    sampling, stops = request.sampling, tuple(sorted(request.stop_token_ids))
    if sampling.stop_token_ids != stops:
        sampling = replace(sampling, stop_token_ids=stops)
    return NewRequestData(
        request_id=request.request_id,
        token_ids=request.all_token_ids,
        block_ids=table,
        num_computed_tokens=start,
        num_scheduled_tokens=num_new,
        sampling=sampling,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_lookahead_tokens=lookahead,
        lora_name=request.lora_name,
        structured=request.structured,
        traceparent=request.trace_context[0],
        tracestate=request.trace_context[1],
    )


@dataclass(frozen=True)
class Placed:
    """Where a scheduled request's blocks stand after this step's allocation: its whole
    `table` (read only for a new request or a replaced table), the blocks `added` now,
    whether the worker holds nothing for it yet (`is_new`) and whether earlier blocks were
    replaced (copy-on-write, a sliding window)."""

    table: list[int]
    added: list[int]
    is_new: bool
    replaced: bool


def scheduled(
    request: Request, placed: Placed, start: int, num_new: int, lookahead: int, samples: bool
) -> ScheduledRequest:
    """The step's entry for a request computing `num_new` tokens from `start`."""
    rid = request.request_id
    if placed.is_new:
        work = new_request_data(request, placed.table, start, num_new, lookahead)
    elif placed.replaced:
        work = CachedRequestData(rid, (), num_new, placed.table, lookahead)
    else:
        work = CachedRequestData(rid, placed.added, num_new, (), lookahead)
    return ScheduledRequest(request, work, start, samples)


@dataclass
class PoolStepPlan:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests the worker must drop from its persistent batch before running.
    dropped_request_ids: list[str] = field(default_factory=list)
    # Recompute victims: blocks freed, num_computed_tokens reset; the caller re-queues them.
    preempted: list[Request] = field(default_factory=list)
    # Swap victims (they stay in this pool, in `swapped`).
    swapped_out: list[Request] = field(default_factory=list)
    # Block copies the worker runs before the forward pass, in this order:
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, swap) blocks
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (swap, device) blocks
    offload_in: list[tuple[int, int]] = field(default_factory=list)  # (offload, device)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    # After the forward pass: full blocks saved to the offload tier (device, offload).
    offload_out: list[tuple[int, int]] = field(default_factory=list)
    # The disk tier, before the forward pass: offload blocks written to it, then blocks
    # read from it into held offload blocks.
    disk_saves: list[DiskBlock] = field(default_factory=list)
    disk_loads: list[DiskBlock] = field(default_factory=list)
    # Before those: later deadlines of blocks on disk only (a retained request finished).
    disk_retains: list[DiskRetain] = field(default_factory=list)
    # Tags of KV receives given up on: from this step on none may write into the pool.
    cancelled_transfer_tags: list[int] = field(default_factory=list)
    # KV from peers (`kv_peer_connector.PeerLoads`); with no token scheduled, `await_kv`
    # asks the worker to answer once a load ends or the next plan arrives.
    kv_loads: list[KvLoad] = field(default_factory=list)
    await_kv: bool = False

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def worker_plan(self, step_id: int) -> StepPlan:
        """The plan the worker runs: the scheduled requests' entries as they were made."""
        return StepPlan(
            step_id=step_id,
            finished_ids=self.dropped_request_ids,
            new=[s.work for s in self.scheduled if s.is_new],
            cached=[s.work for s in self.scheduled if not s.is_new],
            moves=BlockMoves(
                swap_out=self.swap_out,
                swap_in=self.swap_in,
                offload_in=self.offload_in,
                copies=self.block_copies,
                offload_out=self.offload_out,
                disk_saves=self.disk_saves,
                disk_loads=self.disk_loads,
                disk_retains=self.disk_retains,
            ),
            cancelled_transfer_tags=self.cancelled_transfer_tags,
            kv_loads=self.kv_loads,
            await_kv=self.only_awaits_kv,
        )

    @property
    def only_awaits_kv(self) -> bool:
        """An `await_kv` plan whose result nothing waits for (no tokens, no disk reads):
        the worker answers it once a KV load ends or the next plan arrives."""
        return self.await_kv and not (self.scheduled or self.disk_loads)

    @property
    def is_empty(self) -> bool:
        return not (
            self.scheduled
            or self.dropped_request_ids
            or self.swap_out
            or self.cancelled_transfer_tags
            or self.kv_loads
            or self.await_kv
            or self.disk_loads
            or self.disk_retains  # sent alone too: a retained request just finished
            or self.offload_in  # a decode pool's loads at a hand-off
            or self.offload_out
        )


@dataclass(frozen=True)
class SampledToken:
    """One token a step sampled for a request, as applied to the request."""

    request: Request
    token_id: int
    logprob: Logprob | None
    # The request's prompt logprobs, on its first token only (when it asked for them).
    prompt_logprobs: list[Logprob]
    # Set when this token ended the request (a stop token, max_tokens, the context length).
    finish_reason: FinishReason | None


@dataclass
class StepUpdate:
    """What one step's result changed, in the order the tokens were applied."""

    tokens: list[SampledToken] = field(default_factory=list)
    # Requests that finished in this step (their blocks here are already free).
    finished: list[Request] = field(default_factory=list)
    # Prompts done in a pool that does not decode: out of its queues, holding their blocks,
    # waiting to move to a decode pool.
    ready_for_handoff: list[Request] = field(default_factory=list)
    # Tokens for requests with none pending (they started over after a failure): dropped.
    unexpected: list[str] = field(default_factory=list)
    # Requests whose result could not be applied (a bug): out of this pool's queues, their
    # blocks here freed; the caller fails each alone, not the pool.
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
