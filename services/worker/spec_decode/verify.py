"""Verifying proposed tokens in the step's own forward pass.

A request with lookahead slots gets up to that many proposed tokens (from the worker's
proposer), appended to its input as one-token rows that share its block table: to the
attention kernels they are ordinary decode rows at consecutive positions (each reads the
KV the rows before it wrote in the same pass), so the pure-decode paths (the C++ kernel,
Triton's decode kernel, CUDA graphs) verify them as they decode.

Each of those rows is then sampled as plain decoding would sample it, given the tokens
before it (the proposals before it taken as accepted: penalties see them, a seeded draw
uses its own output position). A proposal is accepted while it equals the token sampled
at its position; the first sample that differs, or the one after the last proposal, is the
step's last token. For a deterministic proposer (n-gram lookup; a draft model proposing
its argmax) this is the rejection-sampling rule with a one-hot draft distribution q: a
proposal d is accepted with probability p(d) = min(1, p(d)/q(d)), and on rejection the
token comes from p restricted to tokens other than d, which is the normalised (p - q)+.
So greedy output is plain decoding's, token for token, and a seeded request's output is
plain decoding's too (same noise at the same output position), whatever its neighbours.
Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Verified:
    """One request's outcome: the accepted proposals, then the step's last token."""

    accepted: list[int]
    token: int
    num_drafts: int


def verify(drafts: Sequence[int], samples: Sequence[int]) -> Verified:
    """`samples[j]`: the token sampled at proposal j's position (j = len(drafts): after the
    last proposal). Accept while they agree."""
    if len(samples) != len(drafts) + 1:
        raise ValueError(f"{len(samples)} samples for {len(drafts)} proposals")
    accepted = 0
    while accepted < len(drafts) and samples[accepted] == drafts[accepted]:
        accepted += 1
    return Verified(list(drafts[:accepted]), samples[accepted], len(drafts))


class Proposer(Protocol):
    """Proposes from one request's tokens alone (n-gram lookup)."""

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> Sequence[int]:
        """Up to `max_tokens` tokens likely to follow `token_ids` (may be none)."""


class BatchProposer(Protocol):
    """Proposes for the step's requests together (a draft model's batched passes)."""

    # The last call's steady passes (none catching a prompt up): their seconds and count.
    priced: tuple[float, int]

    def propose_batch(self, requests: Sequence[tuple[Any, int]]) -> list[list[int]]:
        """For each (worker request, k): up to k tokens likely to follow its tokens."""
