"""What passes between a pool's scheduler and its worker, as domain objects: the plan of
one step (`PoolStepPlan`, what `PoolScheduler.schedule()` returns) and what applying the
step's result changed (`StepUpdate`, what `PoolScheduler.update()` returns). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.request import FinishReason, Logprob, Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # True when the worker has no state for the request yet: send its full data.
    is_new: bool
    # Blocks appended to the table this step (the whole table when is_new).
    new_block_ids: list[int]
    # Tokens already computed before this step (where the new tokens start).
    num_computed_before: int
    # The request's whole table when copy-on-write replaced some of its blocks.
    replaced_table: list[int] | None = None
    # The step reaches the request's last token and samples the next one.
    samples: bool = False
    # Slots (blocks allocated) after the new tokens for proposals the worker verifies in
    # this step (speculative decoding); only when it samples.
    num_lookahead_tokens: int = 0


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
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    # Tags of KV receives given up on: from this step on none may write into the pool.
    cancelled_transfer_tags: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (
            self.scheduled
            or self.dropped_request_ids
            or self.swap_out
            or self.cancelled_transfer_tags
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
