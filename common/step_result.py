"""What one step produced, in the one shape it keeps from the worker's runner to the
scheduler's `PoolScheduler.update()`: the runner returns a `StepResult`, the worker sends it
(`step_result_pb.py`, the only other form it takes), the scheduler applies it. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.sampling import Logprob


@dataclass(frozen=True)
class PromptLogprobs:
    """Entries for prompt positions start, start + 1, ... (each given the tokens before it)."""

    start: int
    entries: tuple[Logprob, ...]


@dataclass(frozen=True)
class SpecOutcome:
    """A request's verified proposals this step: those accepted (they come before its
    sampled token), how many were proposed, and the accepted ones' logprobs (None entries
    when it did not ask)."""

    accepted: list[int]
    num_draft_tokens: int
    logprobs: list[Logprob | None]

    @property
    def num_accepted_tokens(self) -> int:
        return len(self.accepted)


@dataclass(frozen=True)
class KvLoadDone:
    """How one KV load of a plan (`StepPlan.kv_loads`) ended: written (no `error`), or not
    (nothing of it is served); `pull_refused`: the source's shared pool cannot be mapped
    here, so that pair must use UCX."""

    tag: int
    num_bytes: int = 0
    seconds: float = 0.0
    source_lag_seconds: float = 0.0  # a streamed pull: the source's last layer -> here
    error: str = ""
    pull_refused: bool = False


@dataclass(frozen=True)
class StepResult:
    step_id: int
    # request id -> the step's last token for it, in plan order (with speculative decoding
    # the accepted proposals in `spec` come before it)
    sampled: dict[str, int]
    execute_seconds: float
    logprobs: dict[str, Logprob] = field(default_factory=dict)  # requests that asked
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    spec: dict[str, SpecOutcome] = field(default_factory=dict)
    # Of execute_seconds: the draft model's steady passes (no prompt caught up), and count
    # (the scheduler's slot policy prices a draft by them: spec_goodput.py).
    propose_seconds: float = 0.0
    propose_passes: int = 0
    # The worker was draining (SIGTERM) when it sent this result.
    draining: bool = False
    # The disk tier: this step's disk_loads now in their offload blocks, those that were
    # not (never served), and blocks it let go since the last result (block hashes).
    disk_loaded: tuple[bytes, ...] = ()
    disk_failed: tuple[bytes, ...] = ()
    disk_removed: tuple[bytes, ...] = ()
    # Seconds spent loading offload blocks into the pool, and reading the disk tier.
    offload_load_seconds: float = 0.0
    disk_read_seconds: float = 0.0
    # KV loads from peers that ended since the last result.
    kv_loads_done: tuple[KvLoadDone, ...] = ()

    @property
    def accepted_tokens(self) -> dict[str, list[int]]:
        """request id -> its accepted proposals, for the requests that accepted any."""
        return {rid: o.accepted for rid, o in self.spec.items() if o.accepted}

    def accepted_with_logprobs(self, request_id: str) -> list[tuple[int, Logprob | None]]:
        """The request's accepted proposals with their logprobs, in order (none: [])."""
        outcome = self.spec.get(request_id)
        if outcome is None:
            return []
        return list(zip(outcome.accepted, outcome.logprobs, strict=True))
