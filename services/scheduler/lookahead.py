"""Lookahead slots for speculative decoding: how many proposals a decoding request may have
verified in its next step, and the pool's counts of what was proposed and accepted.

A request's step with k lookahead slots computes its last token plus up to k proposals and
emits between 1 and k + 1 tokens, so the slots are capped by what the request may still
emit (`max_tokens`), the context length, and the step's token budget; at or above
`disable_by_batch_size` running requests a step plans none (vLLM's setting). The KV of
accepted proposals counts as computed when the result comes in (`num_computed_tokens`
catches up by that many); rejected slots are simply written again later.

With async scheduling a request whose proposals are still in flight is planned again
before their result is in, like any decoding request: its next step computes one token
(the one its step in flight samples), wherever the worker's copy of the request ends, which
only the worker knows yet. The scheduler allocates blocks for the most the steps in flight
can bring (`num_lookahead_in_flight` more tokens) and caps the next slots as if they all
were accepted; when they may have finished the request (`max_tokens`, the context) it
waits for them instead. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.step_result import SpecOutcome
from services.scheduler.request import Request


@dataclass(frozen=True)
class Lookahead:
    num_speculative_tokens: int
    disable_by_batch_size: int = 0  # 0: never off
    # Slots only where they pay (spec_goodput.py); False: every slot `slots` allows.
    goodput: bool = True

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1: {self.num_speculative_tokens}")

    def slots(self, request: Request, budget: int, batch_size: int) -> int:
        """Proposal slots for the request's next decoding step (0: a plain step)."""
        if self.disable_by_batch_size and batch_size >= self.disable_by_batch_size:
            return 0
        ahead = request.num_lookahead_in_flight  # counted as if all accepted
        produced = len(request.output_token_ids) + request.num_pending_tokens + ahead
        room = request.max_tokens - produced - 1  # the step emits 1 + accepted tokens
        if request.max_model_len is not None:
            room = min(room, request.max_model_len - request.num_tokens - ahead - 1)
        return max(0, min(self.num_speculative_tokens, room, budget))

    @staticmethod
    def can_plan_ahead(request: Request) -> bool:
        """Whether a request with proposals in flight may be planned before their result:
        not if accepting all of them could end it (max_tokens, the context length)."""
        ahead = request.num_lookahead_in_flight
        produced = len(request.output_token_ids) + request.num_pending_tokens + ahead
        if produced >= request.max_tokens:
            return False
        return request.max_model_len is None or request.num_tokens + ahead < request.max_model_len


@dataclass
class SpecDecodeCounters:
    """Since the worker joined: steps in which a request verified proposals, tokens
    proposed, and accepted."""

    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, counts: SpecOutcome) -> None:
        self.num_steps += 1
        self.num_draft_tokens += counts.num_draft_tokens
        self.num_accepted_tokens += counts.num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a request gains per verifying step (1 + accepted / steps)."""
        return 1.0 + self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0
