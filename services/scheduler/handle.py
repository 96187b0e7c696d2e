"""A request's place in the engine: which pool holds it, its stage, and its event stream."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from services.scheduler.pool import Pool
from services.scheduler.request import FinishReason, Request


class Stage(enum.Enum):
    PREFILL = "prefill"  # queued or running in a prefill-capable pool
    HANDOFF = "handoff"  # prompt done; holds prefill blocks until a decode pool has room
    TRANSFER = "transfer"  # KV moving over UCX; holds blocks in both pools
    DECODE = "decode"  # in a decode pool
    DONE = "done"


@dataclass(frozen=True)
class Finished:
    """The last event of a request's stream."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Set when the request failed: (status name, message), e.g. ("UNAVAILABLE", "...").
    error: tuple[str, str] | None = None


@dataclass(eq=False)
class RequestHandle:
    request: Request
    pool: Pool
    stage: Stage = Stage.PREFILL
    # Token lists, then one Finished.
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def done(self) -> bool:
        return self.stage is Stage.DONE
