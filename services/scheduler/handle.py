"""A request's place in the engine: which pool holds it, its stage, and its event stream.

Every stage change goes through a method of `RequestHandle`, checked against the one
table of allowed moves (`_NEXT`):

    PREFILL -> HANDOFF -> TRANSFER -> DECODE        the disaggregated path
    DECODE -> HANDOFF (-> DECODE)                   a draining decode pool hands it on with
                                                    its KV (or takes it back before the move)
    PREFILL -> PREFILL, DECODE -> PREFILL           preempted: recompute in a prefill pool
    PREFILL | DECODE | TRANSFER -> PARKED           finished, its KV kept where it decodes
                                                    (`Request.keep_kv`)
    any live stage -> RECOVERING                    released (finishing, or starting over)
    RECOVERING -> PREFILL | DONE                    started over, or finished
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.scheduler.pool import Pool
from services.scheduler.request import FinishReason, Logprob, Request

if TYPE_CHECKING:
    from services.scheduler.request_trace import RequestTrace


class Stage(enum.Enum):
    PREFILL = "prefill"  # queued or running in a prefill-capable pool
    HANDOFF = "handoff"  # holds its blocks (prompt done, or draining) until pulled
    TRANSFER = "transfer"  # KV moving over UCX; holds blocks in both pools
    DECODE = "decode"  # in a decode pool
    PARKED = "parked"  # finished; its blocks stay in its pool until forked or released
    RECOVERING = "recovering"  # holds nothing; about to start over after a failure
    DONE = "done"


_NEXT = {
    Stage.PREFILL: {Stage.PREFILL, Stage.HANDOFF, Stage.PARKED, Stage.RECOVERING},
    Stage.HANDOFF: {Stage.TRANSFER, Stage.DECODE, Stage.RECOVERING},
    Stage.TRANSFER: {Stage.DECODE, Stage.PARKED, Stage.RECOVERING},
    Stage.DECODE: {Stage.PREFILL, Stage.HANDOFF, Stage.PARKED, Stage.RECOVERING},
    Stage.PARKED: {Stage.RECOVERING},
    Stage.RECOVERING: {Stage.RECOVERING, Stage.PREFILL, Stage.DONE},
    Stage.DONE: set(),
}


@dataclass(frozen=True)
class Tokens:
    """New tokens of one sample (with their logprobs, and the prompt's on the first)."""

    index: int
    token_ids: list[int]
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    # Prompt tokens served from the prefix cache, on the sample's first tokens.
    cached_tokens: int | None = None


@dataclass(frozen=True)
class Finished:
    """The last event of one sample."""

    index: int
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Set when the request failed: (status name, message), e.g. ("UNAVAILABLE", "...").
    error: tuple[str, str] | None = None
    # Speculative decoding: tokens proposed for this sample, and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Beam search: the hypothesis' score (HF's sequences_scores).
    beam_score: float | None = None


@dataclass(frozen=True)
class TransferPart:
    """Blocks of one transfer that become final together: once the source worker has run
    step `ready_step_id` (0: final already). `last`: no part follows."""

    src_blocks: list[int]
    dst_blocks: list[int]
    ready_step_id: int
    last: bool


@dataclass(eq=False)
class Transfer:
    """A KV transfer: its task, both pools, its tag, and its parts, queued as they become
    known (one for a finished prompt; one per prompt chunk when streamed). A transfer
    streamed while the prompt still runs can end first: `done` until the prompt's result
    comes in."""

    task: asyncio.Task
    src: Pool
    dst: Pool
    tag: int
    parts: asyncio.Queue[TransferPart]
    # The request's decode-side blocks, from block `first_block` of its table on; blocks
    # from `next_block` on are in no part yet.
    dst_blocks: list[int]
    first_block: int
    next_block: int
    done: bool = False

    def add_part(self, src_table: list[int], end_block: int, ready_step_id: int, last: bool):
        """Queue blocks `next_block`..`end_block` of the request's table (`src_table`: its
        blocks in the source pool), final after `ready_step_id`; the last part takes every
        block left."""
        if last:
            end_block = self.first_block + len(self.dst_blocks)
        if end_block <= self.next_block and not last:
            return
        start, self.next_block = self.next_block, max(end_block, self.next_block)
        first = self.first_block
        pairs = [
            (s, d)
            for s, d in zip(
                src_table[start:end_block], self.dst_blocks[start - first : end_block - first],
                strict=True,
            )
            # the null block (windowed pools) stands in for KV no query reads: not moved
            if not self.dst.blocks.is_null(d) and not self.src.blocks.is_null(s)
        ]  # fmt: skip
        self.parts.put_nowait(
            TransferPart([s for s, _ in pairs], [d for _, d in pairs], ready_step_id, last)
        )


@dataclass(eq=False)
class RequestHandle:
    request: Request
    pool: Pool
    stage: Stage = Stage.PREFILL
    # Tokens events, then one Finished; shared by the n samples of one client request
    # (an asyncio.Queue, or anything else with `put_nowait`).
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    transfer: Transfer | None = None
    # Times the request started over after a worker or a transfer failed.
    num_restarts: int = 0
    # The pool and step that compute (or computed) the prompt's last chunk: its KV there
    # is final once that worker has run the step.
    prompt_step: tuple[Pool, int] | None = None
    # The client request's span (None: not traced); stage changes are events on it.
    trace: RequestTrace | None = None
    # Stage changes so far. Code that notes it before an await knows afterwards whether
    # the request was cancelled, finished or started over meanwhile (it changed).
    moves: int = 0

    def ready_step_in(self, pool: Pool) -> int:
        """The step of `pool` after which the request's KV there is final (0: already)."""
        if self.prompt_step is None or self.prompt_step[0] is not pool:
            return 0
        return self.prompt_step[1]

    @property
    def done(self) -> bool:
        return self.stage is Stage.DONE

    def _move(self, stage: Stage) -> None:
        if stage not in _NEXT[self.stage]:
            raise AssertionError(
                f"request {self.request.request_id}: no move {self.stage.name} -> {stage.name}"
            )
        self.stage = stage
        self.moves += 1
        if self.trace is not None:
            self.trace.stage(self.request, stage.value)

    def queue_prompt(self, pool: Pool) -> None:
        """Queued in a prefill-capable pool (first time, preempted, or starting over)."""
        self._move(Stage.PREFILL)
        self.pool = pool

    def await_handoff(self) -> None:
        """Prompt done in a prefill pool, or leaving a draining decode pool: holds its blocks
        there until a decode pool pulls it."""
        self._move(Stage.HANDOFF)

    def stay(self) -> None:
        """A move off a draining decode pool called off before it started: that pool
        (still `pool`, still holding the blocks) keeps the request."""
        if self.pool.info.role != "decode":
            raise AssertionError(f"request {self.request.request_id}: only decode pools keep")
        self._move(Stage.DECODE)

    def start_transfer(self, transfer: Transfer | None) -> None:
        """Blocks allocated in the decode pool; KV moving (None: nothing to move)."""
        self._move(Stage.TRANSFER)
        self.transfer = transfer

    def arrive(self, pool: Pool) -> None:
        """KV in place: the decode pool holds the request now (parked, if it finished)."""
        self._move(Stage.PARKED if self.request.is_finished else Stage.DECODE)
        self.pool, self.transfer = pool, None

    def park(self) -> None:
        """Finished in a pool that decodes: its blocks stay there (`Request.keep_kv`)."""
        self._move(Stage.PARKED)

    def hold_nothing(self) -> None:
        """Released everywhere: about to start over or to finish."""
        self._move(Stage.RECOVERING)

    def finish(self) -> None:
        self._move(Stage.DONE)
