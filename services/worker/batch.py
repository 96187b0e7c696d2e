"""The worker's persistent batch: per-request tokens, block table and progress.

The scheduler sends a request's full data once (`NewRequest`) and deltas after
(`CachedRequest`); this module applies them and checks every plan against what the worker
holds, so a plan that would read or write blocks it does not cover fails loudly instead of
corrupting the KV pool. Pure Python: no grpc, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.sampling import SamplingParams
from common.step_plan import CachedRequestData, NewRequestData
from common.structured_output import Constraint


class PlanError(ValueError):
    """A step plan that does not fit the worker's state (a scheduler bug or a stale plan)."""


@dataclass
class WorkerRequest:
    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    num_prompt_tokens: int = 0
    lora_name: str = ""  # its LoRA adapter ("" = the base model)
    structured: Constraint | None = None  # the grammar its output must follow
    # Leading tokens whose KV is in the draft model's pool (speculative decoding with a
    # draft model): stale KV past them is rewritten before it is read.
    num_draft_computed_tokens: int = 0


@dataclass(frozen=True)
class ScheduledWork:
    """One request's share of a forward pass."""

    request: WorkerRequest
    num_new_tokens: int
    # Slots after the new tokens (their blocks are in the table) for proposed tokens this
    # step may verify (speculative decoding); only on a step that samples.
    num_lookahead_tokens: int = 0

    @property
    def samples(self) -> bool:
        """True if this pass computes the request's last known token, so it samples one."""
        return self.request.num_computed_tokens + self.num_new_tokens == len(self.request.token_ids)


class PersistentBatch:
    def __init__(
        self, block_size: int, num_blocks: int, vocab_size: int, num_kv_groups: int = 1
    ) -> None:
        self.block_size = block_size
        self.num_kv_groups = num_kv_groups  # entries per block of tokens in a table
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.requests: dict[str, WorkerRequest] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def clear(self) -> None:
        self.requests.clear()

    def apply(
        self,
        finished_ids: Sequence[str],
        new: Sequence[NewRequestData],
        cached: Sequence[CachedRequestData],
    ) -> list[ScheduledWork]:
        """Apply one plan's changes; returns the work of this step in plan order."""
        for request_id in finished_ids:
            self.requests.pop(request_id, None)
        work: list[ScheduledWork] = []
        for data in new:
            if data.request_id in self.requests:
                raise PlanError(f"request {data.request_id} is already in the batch")
            if any(not 0 <= t < self.vocab_size for t in data.token_ids):
                raise PlanError(f"request {data.request_id} has token ids outside the vocab")
            request = WorkerRequest(
                request_id=data.request_id,
                token_ids=list(data.token_ids),
                block_ids=self._checked_blocks(data.request_id, data.block_ids),
                num_computed_tokens=data.num_computed_tokens,
                sampling=data.sampling,
                num_prompt_tokens=data.num_prompt_tokens or len(data.token_ids),
                lora_name=data.lora_name,
                structured=data.structured,
            )
            self.requests[data.request_id] = request
            work.append(self._work(request, data.num_scheduled_tokens, data.num_lookahead_tokens))
        for delta in cached:
            request = self.requests.get(delta.request_id)
            if request is None:
                raise PlanError(f"request {delta.request_id} is not in the batch")
            if delta.block_table:
                table = self._checked_blocks(delta.request_id, delta.block_table)
                same = 0  # copied blocks hold the target's KV only: the draft's is redone
                while same < min(len(table), len(request.block_ids)) and (
                    table[same] == request.block_ids[same]
                ):
                    same += 1
                request.num_draft_computed_tokens = min(
                    request.num_draft_computed_tokens, same * self.block_size
                )
                request.block_ids = table
            else:
                request.block_ids.extend(
                    self._checked_blocks(delta.request_id, delta.new_block_ids)
                )
            work.append(self._work(request, delta.num_scheduled_tokens, delta.num_lookahead_tokens))
        return work

    def complete(
        self,
        work: Sequence[ScheduledWork],
        sampled: dict[str, int],
        accepted: dict[str, list[int]] | None = None,
    ) -> None:
        """Advance progress after the forward pass and append the sampled tokens, after the
        proposed tokens a request accepted (their KV was written by the pass; a draft
        model's KV past them is stale)."""
        accepted = accepted or {}
        for item in work:
            request = item.request
            extra = accepted.get(request.request_id, ())
            request.num_draft_computed_tokens = min(
                request.num_draft_computed_tokens, len(request.token_ids) + len(extra)
            )
            request.num_computed_tokens += item.num_new_tokens + len(extra)
            request.token_ids.extend(extra)
        for request_id, token in sampled.items():
            self.requests[request_id].token_ids.append(token)

    def _checked_blocks(self, request_id: str, blocks: Sequence[int]) -> list[int]:
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise PlanError(f"request {request_id}: block ids {bad[:4]} outside the pool")
        return list(blocks)

    def _work(self, request: WorkerRequest, num_new: int, lookahead: int = 0) -> ScheduledWork:
        end = request.num_computed_tokens + num_new
        if num_new <= 0 or end > len(request.token_ids):
            raise PlanError(
                f"request {request.request_id}: cannot compute {num_new} tokens from "
                f"{request.num_computed_tokens} of {len(request.token_ids)}"
            )
        if lookahead and end != len(request.token_ids):
            raise PlanError(
                f"request {request.request_id}: lookahead slots on a step that does not sample"
            )
        if end + lookahead > len(request.block_ids) // self.num_kv_groups * self.block_size:
            raise PlanError(
                f"request {request.request_id}: {len(request.block_ids)} blocks cannot hold "
                f"{end + lookahead} tokens"
            )
        return ScheduledWork(request, num_new, lookahead)
