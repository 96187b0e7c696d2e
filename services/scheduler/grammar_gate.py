"""Holds a constrained request back until its grammar is compiled on the workers, so a slow
schema (or the first constraint a worker sees, which loads xgrammar and the tokenizer)
never stalls the steps of other requests: vLLM's "waiting for the FSM" state.

A constraint seen for the first time is sent to every healthy worker's grammar thread
(`prepare_structured`); the requests under it stay in their pool's waiting queue, skipped,
until all answered. Constraints prepared everywhere are remembered (least recently used
forgotten first, and all of them when a worker rejoins with nothing compiled). A worker
that does not answer only costs latency: a step that meets an unprepared constraint
compiles it itself. A constraint a worker refuses ends its requests with
INVALID_ARGUMENT (the gateway checks constraints first, so this is a last line).

The gate says when a constraint is done (`results`: `GrammarDone`, its held requests and
the refusal if any); the engine lets them run or ends them."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.log import get_logger
from common.structured_output import Constraint
from services.scheduler.request import Request
from services.scheduler.worker_types import ConstraintRefusedError

log = get_logger(__name__)
PREPARE_TIMEOUT_S = 60.0
MAX_REMEMBERED = 1024


@dataclass(frozen=True)
class GrammarDone:
    """A constraint's compile ended: its held requests may run (`refusal` None), or end with
    INVALID_ARGUMENT saying `refusal`."""

    requests: tuple[Request, ...]
    refusal: str | None


class GrammarGate:
    def __init__(self, pools: Callable[[], Sequence], spawn: Callable) -> None:
        """`pools()`: the pools now (each with `healthy` and `client`); `spawn(coro, name)`
        runs a task."""
        self._pools = pools
        self._spawn = spawn
        self.results: asyncio.Queue[GrammarDone] = asyncio.Queue()
        self._prepared: OrderedDict[Constraint, None] = OrderedDict()
        self._holding: dict[Constraint, list[Request]] = {}

    def hold(self, samples: Sequence[Request]) -> None:
        """Mark `samples` (one client request) pending until their constraint is ready."""
        constraint = samples[0].structured if samples else None
        if constraint is None:
            return
        if constraint in self._prepared:
            self._prepared.move_to_end(constraint)
            return
        for request in samples:
            request.grammar_pending = True
        holding = self._holding.get(constraint)
        if holding is not None:  # already being prepared
            holding.extend(samples)
            return
        self._holding[constraint] = list(samples)
        self._spawn(self._prepare(constraint), "prepare_structured")

    def forget_prepared(self) -> None:
        """A worker came back without any compiled grammar."""
        self._prepared.clear()

    @property
    def num_holding(self) -> int:
        return sum(len(v) for v in self._holding.values())

    async def _prepare(self, constraint: Constraint) -> None:
        refusal = None
        try:
            pools = [p for p in self._pools() if p.healthy]
            results = await asyncio.gather(
                *(p.client.prepare_structured(constraint, PREPARE_TIMEOUT_S) for p in pools),
                return_exceptions=True,
            )
            refused = [r for r in results if isinstance(r, ConstraintRefusedError)]
            failed = [r for r in results if isinstance(r, Exception) and r not in refused]
            if refused:
                refusal = str(refused[0])
            elif failed:  # a step on that worker compiles it when it needs it
                log.warning("structured_output_prepare_failed", error=str(failed[0]))
            else:
                self._prepared[constraint] = None
                while len(self._prepared) > MAX_REMEMBERED:
                    self._prepared.popitem(last=False)
        finally:
            held = tuple(self._holding.pop(constraint, ()))
            for request in held:
                request.grammar_pending = False
            self.results.put_nowait(GrammarDone(held, refusal))
