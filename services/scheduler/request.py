"""A request as the scheduler sees it: tokens, progress, limits and why it finished.

One rule drives every phase: `num_computed_tokens` catches up with `num_tokens`. A request
whose computed tokens equal its known tokens is waiting for its next sampled token.
Pure Python: no grpc, no torch.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from common.prefix_hash import BlockHash, ChainOrigin, extend_block_hashes
from common.sampling import Logprob, SamplingParams
from common.structured_output import Constraint
from common.tracing import trace_id_of


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token (EOS) was produced
    LENGTH = "length"  # max_tokens or the context length was reached
    ABORT = "abort"  # cancelled by the client, the gateway or a failure


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    cache_salt: str = ""
    # Seconds its prompt's and output's KV blocks are kept (evicted last) once it
    # finishes (0: none; `kv_retention.py`), checked against --max-kv-retention-s.
    kv_retention_s: float = 0.0
    lora_name: str = ""  # its LoRA adapter ("" = the base model)
    structured: Constraint | None = None  # the grammar its output must follow
    grammar_pending: bool = False  # its grammar is still compiling on the workers
    # Which of the client request's n samples this is; samples 1..n-1 name sample 0
    # (`prompt_of`), whose prompt blocks they reuse through the prefix cache.
    index: int = 0
    prompt_of: str = ""
    # What a driver above the engine (a beam search, `beam_driver.py`) asks of a request
    # it submits: finished, its KV stays where it decodes (`keep_kv`: parked until the
    # driver forks or releases it); its KV lost (preempted, swapped out, its worker
    # failed), it ends with ABORTED instead of starting over (`restartable`); it is a
    # part of a client request, not one (`counted`: metrics and the finish log).
    keep_kv: bool = False
    restartable: bool = True
    counted: bool = True
    output_token_ids: list[int] = field(default_factory=list)
    # Leading tokens whose KV sits in the blocks of the pool the request is in now.
    num_computed_tokens: int = 0
    # Tokens a worker has sampled (or will, in a step in flight) that have not arrived yet.
    num_pending_tokens: int = 0
    # Prompt tokens served from the prefix cache at the first admission (-1 = not yet).
    num_cached_tokens: int = -1
    # Parent of the first block's hash (deployment salt + cache_salt), set on submit.
    hash_root: BlockHash = b""
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Prompt log-probabilities gathered while the prompt is computed (positions 1..).
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    # The gathered prompt logprobs went out with the first token.
    prompt_logprobs_sent: bool = False
    num_preemptions: int = 0
    # Speculative decoding: proposal slots of its steps in flight (up to that many more
    # tokens than num_pending_tokens may come back), and its proposed and accepted tokens;
    # its tokens when a step last gave it slots (a draft model's KV was caught up then).
    num_lookahead_in_flight: int = 0
    num_draft_synced_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    finish_reason: FinishReason | None = None
    # W3C (traceparent, tracestate) of the scheduler's span for it ("": not traced); the
    # workers' spans for it are its children.
    trace_context: tuple[str, str] = ("", "")
    arrival_time: float = field(default_factory=time.monotonic)
    # First admitted to run (metrics: queue time = this - arrival, prefill time = first
    # token - this).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def trace_id(self) -> str:
        """Its trace's id for its log lines ("" when it is not traced)."""
        return trace_id_of(self.trace_context[0])

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus those sampled in steps whose results have not arrived."""
        return self.num_known_tokens + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def will_finish(self) -> bool:
        """True when tokens already sampled (arrived or pending) reach a length limit."""
        produced = len(self.output_token_ids) + self.num_pending_tokens
        if produced >= self.max_tokens:
            return True
        return self.max_model_len is not None and self.num_tokens >= self.max_model_len

    @property
    def ends_at_its_next_token(self) -> bool:
        """The next token sampled (the one a prompt's last step samples, before any is
        pending) reaches a length limit: a stop token may still end it sooner."""
        if len(self.output_token_ids) + 1 >= self.max_tokens:
            return True
        return self.max_model_len is not None and self.num_known_tokens + 1 >= self.max_model_len

    @property
    def chain_origin(self) -> ChainOrigin:
        """What its hash root mixes besides the deployment salt (published with the KV
        events of its first block)."""
        return ChainOrigin(self.cache_salt, self.lora_name, len(self.prompt_token_ids))

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hashes of every full block of the known tokens (computed incrementally)."""
        if not self.hash_root:
            return self.block_hashes
        return extend_block_hashes(
            self.block_hashes, self.all_token_ids, block_size, self.hash_root
        )

    def append_token(self, token_id: int) -> FinishReason | None:
        """Record a sampled token; returns (and records) the finish reason if it ends here."""
        if self.is_finished:
            raise ValueError(f"request {self.request_id} already finished")
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        if (
            token_id in self.stop_token_ids
            and len(self.output_token_ids) > self.sampling.min_tokens
        ):
            self.finish_reason = FinishReason.STOP
        elif len(self.output_token_ids) >= self.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        elif self.max_model_len is not None and self.num_known_tokens >= self.max_model_len:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason
