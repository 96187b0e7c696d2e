"""Draining a decode pool by moving its requests away with their KV: a mixin of
`PoolScheduler` (it uses the scheduler's queues, steps in flight and block managers).

While `migrating` is set (the engine sets it on a draining decode pool while another
decode pool accepts), `schedule()` plans no more work for the pool's requests, only
swap-ins of swapped ones, so the steps in flight run out. A request may leave once no
step in flight computes for it (nothing pending): `take_migrations` takes it out of the
queues; it keeps its blocks for the hand-off, which moves its KV to another decode pool,
where it goes on from its last sampled token with nothing recomputed.

A request that left stays in the worker's batch until its blocks here are freed (its KV
arrived elsewhere, or the move was given up); only then does the next plan drop it. So a
draining worker stays busy, and its KV stays put, until every move is done; and a request
taken back before its move started (`take_back`: the drain ended, or no decode pool is
left to take it) is still on the worker, in step with the scheduler.
"""

from __future__ import annotations

from services.scheduler.request import Request


class Migration:
    def take_migrations(self) -> list[Request]:
        """While migrating: take out every running or waiting request that holds KV here
        and that no step in flight computes for; each keeps its blocks (the hand-off
        frees them once its KV has moved). Oldest first."""
        if not self.migrating:
            return []
        busy = {rid for _, step, _, _ in self._in_flight for rid in step}
        ready = [
            r
            for r in (*self.running, *self.waiting)
            if r.request_id not in busy
            and not r.num_pending_tokens
            and r.num_computed_tokens
            and not r.is_finished
        ]
        for request in ready:
            (self.running if request in self.running else self.waiting).remove(request)
            if request.request_id in self._on_worker:
                self._leaving[request.request_id] = request
        self.num_migrations_out += len(ready)
        return ready

    def take_back(self, request: Request) -> None:
        """A move that has not started is called off: the request (still holding its
        blocks here, and still in the worker's batch if it ran here) waits here again."""
        self._leaving.pop(request.request_id, None)
        self.waiting.appendleft(request)

    def _drop_departed(self) -> None:
        """Drop from the worker's batch the requests that left and whose blocks here are
        freed (their KV arrived elsewhere, or the request ended or started over)."""
        for rid, request in list(self._leaving.items()):
            if not self.blocks.has(rid):
                del self._leaving[rid]
                self._drop_from_worker(request)
