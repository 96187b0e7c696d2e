"""How a fake worker runs its step plans (`tests/fake_worker.py`): the plan as copied when
sent, the persistent batch's requests, and the execution itself: a step writes the tokens
it computes into the request's blocks and samples by reading the whole sequence back from
them through the fake model, so a wrong block table, transfer, prefix hit, copy or swap
changes the token (and is recorded in `kv_errors`); speculative proposals are right for a
varying prefix and their KV is written as a verify pass writes it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.sampling import Logprob
from common.step_result import SpecOutcome
from tests.fake_model import fake_top, model_token


@dataclass
class PlanItem:
    """One scheduled request of a plan, copied when the plan is sent (the scheduler's
    Request objects change afterwards)."""

    request_id: str
    is_new: bool
    token_ids: list[int]
    block_ids: list[int]
    num_computed_before: int
    num_new_tokens: int
    replaced_table: list[int] | None
    num_lookahead_tokens: int = 0
    num_logprobs: int | None = None


@dataclass
class StepPlan:
    step_id: int
    items: list[PlanItem]
    dropped: list[str]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copies: list[tuple[int, int]]
    cancelled_transfer_tags: list[int]
    await_kv: bool = False


@dataclass
class FakeRequest:
    """A request in the fake worker's persistent batch."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_logprobs: int | None = None


@dataclass
class StepRecord:
    step_id: int
    scheduled: list[tuple[str, int]]  # (request id, new tokens)
    dropped: list[str]
    cancelled_transfer_tags: list[int]
    sampled: dict[str, int] = field(default_factory=dict)


class FakeStepExecution:
    """The step half of `FakeWorker` (a mixin over its state)."""

    def _execute(self, plan: StepPlan) -> dict[str, int]:
        bs = self.info.block_size
        for request_id in plan.dropped:
            self.batch.pop(request_id, None)
        work: list[tuple[FakeRequest, int]] = []
        lookahead: dict[str, int] = {}
        for item in plan.items:
            if item.is_new:
                if item.request_id in self.batch:
                    raise ValueError(f"request {item.request_id} is already in the batch")
                bad = [t for t in item.token_ids if not 0 <= t < self.info.model.vocab_size]
                if bad:
                    raise ValueError(f"request {item.request_id} has token ids outside the vocab")
                request = FakeRequest(
                    item.request_id,
                    list(item.token_ids),
                    self._checked(item.block_ids),
                    item.num_computed_before,
                    item.num_logprobs,
                )
                self.batch[item.request_id] = request
            else:
                request = self.batch.get(item.request_id)
                if request is None:
                    raise ValueError(f"request {item.request_id} is not in the batch")
                if item.replaced_table:
                    request.block_ids = self._checked(item.replaced_table)
                else:
                    request.block_ids.extend(self._checked(item.block_ids))
            end = request.num_computed_tokens + item.num_new_tokens
            if item.num_new_tokens <= 0 or end > len(request.token_ids):
                raise ValueError(
                    f"request {request.request_id}: cannot compute {item.num_new_tokens} "
                    f"tokens from {request.num_computed_tokens} of {len(request.token_ids)}"
                )
            if end > len(request.block_ids) * bs:
                raise ValueError(
                    f"request {request.request_id}: {len(request.block_ids)} blocks cannot "
                    f"hold {end} tokens"
                )
            if item.num_lookahead_tokens and end != len(request.token_ids):
                raise ValueError(f"request {request.request_id}: lookahead without sampling")
            if end + item.num_lookahead_tokens > len(request.block_ids) * bs:
                raise ValueError(
                    f"request {request.request_id}: {len(request.block_ids)} blocks cannot "
                    f"hold {end} tokens and {item.num_lookahead_tokens} lookahead slots"
                )
            work.append((request, item.num_new_tokens))
            lookahead[request.request_id] = item.num_lookahead_tokens
        # Block moves before the forward pass: swap out, swap in, copy-on-write.
        for device, swap in plan.swap_out:
            self._check_swap(swap)
            self.swap_kv[swap] = list(self._block(device))
        for swap, device in plan.swap_in:
            self._check_swap(swap)
            self.kv[self._checked([device])[0]] = list(
                self.swap_kv.get(swap, [None] * self.info.block_size)
            )
        for src, dst in plan.copies:
            self._checked([src, dst])
            self.kv[dst] = list(self._block(src))
        # The forward pass: write the KV of every computed token of the batch, then sample
        # each request that reaches its last token from what its blocks hold.
        for request, num_new in work:
            start = request.num_computed_tokens
            for pos in range(start, start + num_new):
                block = self._block(request.block_ids[pos // bs])
                block[pos % bs] = request.token_ids[pos]
        sampled: dict[str, int] = {}
        logprobs: dict[str, Logprob] = {}
        for request, num_new in work:
            if request.num_computed_tokens + num_new == len(request.token_ids):
                seen = [
                    self._block(request.block_ids[pos // bs])[pos % bs]
                    for pos in range(len(request.token_ids))
                ]
                if seen != request.token_ids:
                    self.kv_errors.append(
                        f"step {plan.step_id} request {request.request_id}: KV holds {seen}, "
                        f"tokens are {request.token_ids} (blocks {request.block_ids})"
                    )
                sampled[request.request_id] = model_token(seen, self.info.model.vocab_size)
                if request.num_logprobs is not None:
                    token = sampled[request.request_id]
                    top = fake_top(seen, request.num_logprobs, self.info.model.vocab_size)
                    logprobs[request.request_id] = Logprob(
                        token, dict(top).get(token, -9.0), tuple(top)
                    )
        accepted: dict[str, list[int]] = {}
        spec: dict[str, SpecOutcome] = {}
        for request, _ in work:
            slots = lookahead[request.request_id]
            if slots and request.request_id in sampled:
                accepted[request.request_id], sampled[request.request_id] = self._speculate(
                    request, sampled[request.request_id], slots, plan.step_id
                )
                taken = accepted[request.request_id]
                spec[request.request_id] = SpecOutcome(taken, slots, [None] * len(taken))
        for request, num_new in work:
            extra = accepted.get(request.request_id, [])
            request.num_computed_tokens += num_new + len(extra)
            request.token_ids.extend(extra)
        for request_id, token in sampled.items():
            self.batch[request_id].token_ids.append(token)
        self.spec_results[plan.step_id] = (accepted, spec)
        self.logprob_results[plan.step_id] = logprobs
        self.steps.append(
            StepRecord(
                plan.step_id,
                [(r.request_id, n) for r, n in work],
                plan.dropped,
                plan.cancelled_transfer_tags,
                dict(sampled),
            )
        )
        return sampled

    def _speculate(
        self, request: FakeRequest, first: int, slots: int, step_id: int
    ) -> tuple[list[int], int]:
        """Speculative decoding of the fake model: proposals for the `slots` positions after
        the request's last token, right for the first `a` of them (a varies with the step
        and the length) and wrong after; their KV is written as a real verify pass writes it
        (rejected slots hold wrong tokens). Returns (accepted tokens, the last token)."""
        vocab, bs = self.info.model.vocab_size, self.info.block_size
        true, seq = [first], [*request.token_ids, first]
        for _ in range(slots):
            seq.append(model_token(seq, vocab))
            true.append(seq[-1])
        right = (step_id * 7 + len(request.token_ids)) % (slots + 1)
        drafts = [true[j] if j < right else (true[j] + 1) % vocab for j in range(slots)]
        end = len(request.token_ids)
        for j, token in enumerate(drafts):
            pos = end + j
            self._block(request.block_ids[pos // bs])[pos % bs] = token
        self.proposed_tokens += slots
        return true[:right], true[right]

    def _block(self, block_id: int) -> list[int | None]:
        block = self.kv.get(block_id)
        if block is None:
            block = self.kv[block_id] = [None] * self.info.block_size
        return block

    def _checked(self, block_ids: Sequence[int]) -> list[int]:
        bad = [b for b in block_ids if not 0 <= b < self.info.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:4]} outside the pool of {self.info.num_blocks}")
        return list(block_ids)

    def _check_swap(self, swap_block: int) -> None:
        if not 0 <= swap_block < self.info.num_swap_blocks:
            raise ValueError(f"swap block {swap_block} outside {self.info.num_swap_blocks}")
