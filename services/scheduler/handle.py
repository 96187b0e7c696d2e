"""A request's place in the engine: which pool holds it, its stage, and its event stream."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from services.scheduler.pool import Pool
from services.scheduler.request import FinishReason, Logprob, Request


class Stage(enum.Enum):
    PREFILL = "prefill"  # queued or running in a prefill-capable pool
    HANDOFF = "handoff"  # prompt done; holds prefill blocks until a decode pool has room
    TRANSFER = "transfer"  # KV moving over UCX; holds blocks in both pools
    DECODE = "decode"  # in a decode pool
    RECOVERING = "recovering"  # holds nothing; about to start over after a failure
    DONE = "done"


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


@dataclass(eq=False)
class Transfer:
    """A KV transfer in flight: its task, both pools and its UCX tag."""

    task: asyncio.Task
    src: Pool
    dst: Pool
    tag: int


@dataclass(eq=False)
class RequestHandle:
    request: Request
    pool: Pool
    stage: Stage = Stage.PREFILL
    # Tokens events, then one Finished; shared by the n samples of one client request
    # (an asyncio.Queue, or anything else with `put_nowait`).
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt_logprobs_sent: bool = False
    transfer: Transfer | None = None
    # Times the request started over after a worker or a transfer failed.
    num_restarts: int = 0

    @property
    def done(self) -> bool:
        return self.stage is Stage.DONE
