"""Which requests a pool's worker keeps in its persistent batch, as the pool's scheduler
knows it, and which the next plan must drop from it.

A request joins when a plan first schedules it and is dropped (its id goes out with the
next plan) when it leaves the pool: finished, preempted, released. A request that left
with its KV (a draining pool's migration, `PoolScheduler.take_migrations`) is `leaving`:
it stays in the batch until its blocks here are freed (its KV arrived elsewhere, or the
move was given up), so the worker keeps its KV, in step with the scheduler, until every
move is done; one taken back before its move started (`stay`) is simply still there.
Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable


class WorkerBatch:
    def __init__(self) -> None:
        self._members: set[str] = set()
        self._drops: list[str] = []
        self._leaving: dict[str, None] = {}  # ordered: drops go out oldest first

    def has(self, request_id: str) -> bool:
        return request_id in self._members

    def join(self, request_id: str) -> None:
        self._members.add(request_id)

    def drop(self, request_id: str) -> None:
        """The request leaves the worker's batch with the next plan."""
        if request_id in self._members:
            self._members.discard(request_id)
            self._drops.append(request_id)

    def take_drops(self) -> list[str]:
        """The ids the next plan drops."""
        drops, self._drops = self._drops, []
        return drops

    def leave(self, request_id: str) -> None:
        """The request left the pool with its KV: it stays in the batch until its blocks
        here are freed (`drop_departed`)."""
        if request_id in self._members:
            self._leaving[request_id] = None

    def stay(self, request_id: str) -> None:
        """A move that has not started is called off: the request is still in the batch."""
        self._leaving.pop(request_id, None)

    def come_back(self, request_id: str) -> None:
        """A request that left is queued here again before it was dropped: drop its old
        entry (it comes back as a new request, with a full table)."""
        if self._leaving.pop(request_id, 0) is None:
            self.drop(request_id)

    def drop_departed(self, holds_blocks: Callable[[str], bool]) -> None:
        """Drop the requests that left and whose blocks here are freed."""
        for request_id in [r for r in self._leaving if not holds_blocks(r)]:
            del self._leaving[request_id]
            self.drop(request_id)
