"""Executes one step: flattens the scheduled tokens, runs the model over the paged KV cache
(replaying a CUDA graph for pure-decode steps when the worker captured them), and samples a
token for every request that caught up.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.worker.batch import ScheduledWork
from services.worker.cuda_graphs import DecodeGraphs
from services.worker.kv_cache import KvCache
from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata
from services.worker.sampler import sample


@dataclass(frozen=True)
class StepOutput:
    sampled: dict[str, int]  # request_id -> token id, in plan order
    execute_seconds: float


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KvCache,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.graphs = graphs
        self.generator = torch.Generator(device=device)
        self.generator.seed()

    @torch.inference_mode()
    def execute(self, work: Sequence[ScheduledWork]) -> StepOutput:
        start = time.perf_counter()
        if not work:
            return StepOutput({}, 0.0)
        input_ids: list[int] = []
        slices: list[SequenceSlice] = []
        for item in work:
            req = item.request
            begin = req.num_computed_tokens
            input_ids.extend(req.token_ids[begin : begin + item.num_new_tokens])
            slices.append(SequenceSlice(begin, item.num_new_tokens, req.block_ids))
        positions, meta = build_attention_metadata(slices, self.kv_cache.block_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        if self.graphs is not None and self.graphs.supports(meta):
            hidden = self.graphs.run(ids, positions, meta)
        else:
            hidden = self.model(ids, positions, self.kv_cache, meta)
        samplers = [i for i, item in enumerate(work) if item.samples]
        sampled: dict[str, int] = {}
        if samplers:
            last_rows = torch.tensor(
                [meta.query_start_loc[i + 1] - 1 for i in samplers], device=self.device
            )
            logits = self.model.compute_logits(hidden[last_rows])
            tokens = sample(logits, [work[i].request.sampling for i in samplers], self.generator)
            sampled = {work[i].request.request_id: t for i, t in zip(samplers, tokens, strict=True)}
        return StepOutput(sampled, time.perf_counter() - start)
