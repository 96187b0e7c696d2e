"""Which prefill -> decode links to avoid: a pair of workers whose KV transfer just failed
while both still answer (a cut or partitioned link between them, a half-open connection,
a link too slow for the transfer deadline) is not chosen again for a while.

Without it, a request whose transfer failed over a cut link started over and was handed
to the same decode worker, failed there again after the transfer deadline, and used up
its restarts. A broken pair is skipped by placement for `cool_down_s`
(`--kv-link-cool-down-s`, 30 s), doubled on each failure in a row up to
`max_cool_down_s`; transfers that fail together (under way when the link broke) count
once. After it, one transfer tries the pair again, and a success forgets the failures.
When every decode worker's link from a prefill worker is broken, placement uses them
anyway (a request must go somewhere). A worker that fails or rejoins starts clean.
Pure: no grpc, no clock of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Record:
    failures: int
    until: float


class LinkBreaker:
    def __init__(
        self,
        cool_down_s: float = 30.0,
        max_cool_down_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`max_cool_down_s` defaults to 10x `cool_down_s`."""
        self.cool_down_s = cool_down_s
        self.max_cool_down_s = 10 * cool_down_s if max_cool_down_s is None else max_cool_down_s
        self._clock = clock
        self._records: dict[tuple[str, str], _Record] = {}

    def failed(self, src: str, dst: str) -> float:
        """A transfer from worker `src` to `dst` failed; returns the cool-down set. The
        transfers that were under way together when the link broke fail together: they
        count once (a failure inside the cool-down does not lengthen it)."""
        record = self._records.get((src, dst))
        now = self._clock()
        if record is not None and now < record.until:
            return record.until - now
        failures = 1 if record is None else record.failures + 1
        cool_down = min(self.max_cool_down_s, self.cool_down_s * 2 ** (failures - 1))
        self._records[(src, dst)] = _Record(failures, now + cool_down)
        return cool_down

    def succeeded(self, src: str, dst: str) -> None:
        self._records.pop((src, dst), None)

    def broken(self, src: str, dst: str) -> bool:
        record = self._records.get((src, dst))
        return record is not None and self._clock() < record.until

    def forget(self, worker: str) -> None:
        """`worker` failed or came back: its links start clean."""
        for pair in [p for p in self._records if worker in p]:
            del self._records[pair]

    def usable(self, src: str, dsts: list[str]) -> list[int]:
        """Indexes of `dsts` whose link from `src` is not broken (all of them if none)."""
        fine = [i for i, dst in enumerate(dsts) if not self.broken(src, dst)]
        return fine or list(range(len(dsts)))
