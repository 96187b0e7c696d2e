"""Executes one step: flattens the scheduled tokens, runs the model over the paged KV cache
(replaying a CUDA graph for pure-decode steps when the worker captured them), samples a
token for every request that caught up, and scores the prompt tokens of requests that asked
for prompt logprobs. A step's results come back from the device in one transfer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from common.sampling import Logprob
from common.step_result import PromptLogprobs, SpecOutcome, StepResult
from services.worker.batch import ScheduledWork
from services.worker.cuda_graphs import DecodeGraphs
from services.worker.kv_cache import KvCache
from services.worker.logprobs import (
    DeviceLogprobs,
    concat,
    prompt_entry_span,
    raw_logprobs,
    to_host,
)
from services.worker.lora.manager import LoraManager
from services.worker.micro_batches import pipelined_forward
from services.worker.models.attention_metadata import (
    AttentionMetadata,
    SequenceSlice,
    build_attention_metadata,
)
from services.worker.sampler import DeviceSample, SamplingRow, sample_on_device, to_device
from services.worker.spec_decode.spec_step import SpecStep
from services.worker.spec_decode.verify import Proposer
from services.worker.structured.state import StructuredOutputs

# Prompt logprobs compute logits for at most this many elements (rows x vocab) at a time.
PROMPT_LOGITS_CHUNK = 1 << 24


class StepShare(Protocol):
    """How the ranks of a parallel worker that do not sample learn a step's results
    (`parallel.rank_context.TokenShare`: the tokens, from rank 0; `parallel.output_share.
    OutputShare`: the whole output, from the last pipeline stage)."""

    pipeline: bool

    @property
    def samples(self) -> bool: ...

    def send(self, tokens: list[int]) -> None: ...

    def receive(self, count: int) -> list[int]: ...

    def send_output(self, output: StepResult) -> None: ...

    def receive_output(self) -> StepResult: ...


@dataclass(frozen=True)
class _PromptScores:
    """Prompt entries scored this step, on the device: spans of rows per request."""

    spans: tuple[tuple[str, int, int], ...]  # (request_id, start position, entry count)
    scores: DeviceLogprobs

    def from_host(self, values: Sequence[Sequence[float]]) -> dict[str, PromptLogprobs]:
        entries = self.scores.from_host(values)
        out, at = {}, 0
        for request_id, start, count in self.spans:
            out[request_id] = PromptLogprobs(start, tuple(entries[at : at + count]))
            at += count
        return out


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KvCache,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
        proposer: Proposer | None = None,
        tokens: StepShare | None = None,
        lora: LoraManager | None = None,
        structured: StructuredOutputs | None = None,
    ) -> None:
        """`proposer`: proposes tokens for requests with lookahead slots (speculative
        decoding); None: lookahead slots stay unused. `tokens`: in a parallel
        worker, how the sampling rank hands its results to the other ranks (which compute
        the same logits collectively, or an earlier pipeline stage's part, but do not
        sample). `lora`: the worker's LoRA adapters (each request's tokens go through its
        adapter's update)."""
        self.model = model
        self.tokens = tokens
        self.proposer = proposer
        self.kv_cache = kv_cache
        self.device = device
        self.graphs = graphs
        self.lora = lora
        self.structured = structured  # grammar masks for constrained requests
        stage = getattr(model, "stage", None)
        self.pipelined = stage is not None and stage.size > 1
        self.generator = torch.Generator(device=device)
        self.generator.seed()

    def _forward(self, ids, positions, meta, slices):
        if self.graphs is not None and self.graphs.supports(meta):
            return self.graphs.run(ids, positions, meta)
        if self.pipelined:  # stages overlap over micro-batches of the step's requests
            return pipelined_forward(self.model, ids, positions, meta, slices, self.kv_cache)
        return self.model(ids, positions, self.kv_cache, meta)

    @torch.inference_mode()
    def execute(self, work: Sequence[ScheduledWork], step_id: int = 0) -> StepResult:
        start = time.perf_counter()
        if not work:
            return StepResult(step_id, {}, 0.0)
        input_ids: list[int] = []
        slices: list[SequenceSlice] = []
        for item in work:
            req = item.request
            begin = req.num_computed_tokens
            input_ids.extend(req.token_ids[begin : begin + item.num_new_tokens])
            slices.append(
                SequenceSlice(begin, item.num_new_tokens, req.block_ids, req.num_prompt_tokens)
            )
        spec = SpecStep(work, self.proposer)  # proposals to verify (see spec_decode)
        spec.rows(input_ids, slices)
        positions, meta = build_attention_metadata(
            slices, self.kv_cache.block_size, self.device, self.kv_cache.num_groups
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        if self.lora is not None:  # each token through its request's adapter
            adapters = [i.request.lora_name for i in work for _ in range(i.num_new_tokens)]
            self.lora.set_pass(adapters, self.device)
        try:
            hidden = self._forward(ids, positions, meta, slices)
        finally:
            if self.lora is not None:
                self.lora.clear_pass()
        if hidden is None:  # an earlier pipeline stage: the last one samples
            return self.tokens.receive_output()
        samplers = [i for i, item in enumerate(work) if item.samples]
        sampling_requests = [work[i].request for i in samplers]
        sample: DeviceSample | None = None
        if samplers:
            flat = [meta.query_start_loc[i + 1] - 1 for i in samplers]
            rows = [
                SamplingRow(r.sampling, r.token_ids, r.num_prompt_tokens) for r in sampling_requests
            ]
            extra_flat, extra_rows = spec.sample_rows(meta.query_start_loc)
            flat.extend(extra_flat)
            rows.extend(extra_rows)
            logits = self.model.compute_logits(hidden[to_device(flat, torch.int64, self.device)])
            if self.structured is not None:
                self.structured.mask(logits, sampling_requests)
            if self.tokens is None or self.tokens.samples:
                sample = sample_on_device(logits, rows, self.generator)
        prompt = self._score_prompts(work, meta, hidden)
        if self.tokens is not None and not self.tokens.samples:
            if self.tokens.pipeline:
                return self.tokens.receive_output()
            shared = self.tokens.receive(len(samplers)) if samplers else []
            sampled = {work[i].request.request_id: t for i, t in zip(samplers, shared, strict=True)}
            return StepResult(step_id, sampled, time.perf_counter() - start)
        sample_tensors = sample.tensors() if sample is not None else []
        prompt_tensors = prompt.scores.tensors() if prompt is not None else []
        values = to_host(sample_tensors + prompt_tensors)  # the step's one device-to-host copy
        sampled: dict[str, int] = {}
        logprobs: dict[str, Logprob] = {}
        outcomes: dict[str, SpecOutcome] = {}
        if sample is not None:
            result = sample.from_host(values[: len(sample_tensors)])
            tokens, entries = result.token_ids, result.logprobs
            if self.tokens is not None and not self.tokens.pipeline:
                self.tokens.send(tokens[: len(samplers)])
            if self.structured is not None:
                self.structured.accept(sampling_requests, tokens)
            for k, i in enumerate(samplers):
                sampled[work[i].request.request_id] = tokens[k]
                if entries[k] is not None:
                    logprobs[work[i].request.request_id] = entries[k]
            outcomes = spec.outcomes(samplers, tokens, entries, sampled, logprobs)
        scored = prompt.from_host(values[len(sample_tensors) :]) if prompt is not None else {}
        output = StepResult(
            step_id,
            sampled,
            time.perf_counter() - start,
            logprobs,
            scored,
            outcomes,
            spec.propose_seconds,
            spec.propose_passes,
        )
        if self.tokens is not None and self.tokens.pipeline:
            self.tokens.send_output(output)
        return output

    def _score_prompts(
        self, work: Sequence[ScheduledWork], meta: AttentionMetadata, hidden: torch.Tensor
    ) -> _PromptScores | None:
        """Raw logprobs of the prompt tokens this step's chunks predict, for requests that
        asked: the hidden state at position p - 1 scores prompt token p."""
        spans: list[tuple[str, int, int]] = []
        rows: list[int] = []
        targets: list[int] = []
        widths: list[int] = []
        for i, item in enumerate(work):
            req = item.request
            if req.sampling.prompt_logprobs is None:
                continue
            begin = req.num_computed_tokens
            start, count = prompt_entry_span(begin, item.num_new_tokens, req.num_prompt_tokens)
            if count == 0:
                continue
            first_row = meta.query_start_loc[i]
            spans.append((req.request_id, start, count))
            rows.extend(range(first_row, first_row + count))
            targets.extend(req.token_ids[start : start + count])
            widths.extend([req.sampling.prompt_logprobs] * count)
        if not rows:
            return None
        row_index = to_device(rows, torch.int64, self.device)
        target_ids = to_device(targets, torch.int64, self.device)
        step = max(1, PROMPT_LOGITS_CHUNK // self.model.config.vocab_size)
        parts = [
            raw_logprobs(
                self.model.compute_logits(hidden[row_index[at : at + step]]),
                target_ids[at : at + step],
                widths[at : at + step],
                width=max(widths),
            )
            for at in range(0, len(rows), step)
        ]
        return _PromptScores(tuple(spans), concat(parts))
