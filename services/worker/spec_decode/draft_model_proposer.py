"""Draft-model proposals: a smaller model (or the target's first layers) with its own paged
KV pool guesses each request's next k tokens, batched over the step's requests.

The draft pool has the target pool's blocks and block size (its own layer count, heads and
head size), and a request's draft KV lives in the same block ids as its target KV: the
scheduler's block table and lookahead slots cover both, so the draft needs no allocation of
its own. `WorkerRequest.num_draft_computed_tokens` says how much of the request's draft KV
is current; the batch lowers it when proposals are rejected (their KV is stale) or blocks are
replaced, and a request new to this worker (a transferred prompt, a recompute, a swap-in, a
migrated request) starts at 0. So the draft computes its prompt KV here, on the decode side,
in the first round of the request's first speculative step (see docs/architecture.md for
why not on the prefill worker).

One `propose_batch` call is k forward passes of the draft: the first catches every request
up (the tokens since its draft KV ends: the sampled token, at most one more after a fully
accepted step, or the whole prompt) and proposes one token; each later pass feeds the
previous proposals back as one-token rows. Proposals are the draft's argmax after the
request's own logit processors (logit_bias, min_tokens, penalties: what the target applies
too), so they are deterministic and the verifier's accept-while-equal rule is exact
rejection sampling (`verify`). Runs on the worker's tensor thread, eager (no CUDA graphs
for the draft).

`priced` is what the last call's steady passes cost: the seconds and count of its passes of
at most two tokens a request (every later pass, and the first unless it caught a request
up by more): the scheduler prices a pass with them (`spec_goodput`), and a prompt's
one-off catching up would overstate what the next pass costs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from services.worker.batch import WorkerRequest
from services.worker.kv_cache import KvCache
from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata
from services.worker.sampler import SamplingRow, process_logits


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, kv_cache: KvCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.priced: tuple[float, int] = (0.0, 0)  # the last call's steady passes: s, count

    def propose_batch(self, requests: Sequence[tuple[WorkerRequest, int]]) -> list[list[int]]:
        """Up to k proposals for each (request, k), k >= 1; writes the draft KV of each
        request's tokens and of all but its last proposal."""
        if not requests:
            return []
        input_ids: list[int] = []
        slices: list[SequenceSlice] = []
        for request, _ in requests:
            tokens = request.token_ids
            start = min(request.num_draft_computed_tokens, len(tokens) - 1)
            input_ids.extend(tokens[start:])
            slices.append(
                SequenceSlice(
                    start, len(tokens) - start, request.block_ids, request.num_prompt_tokens
                )
            )
            request.num_draft_computed_tokens = len(tokens)
        proposals: list[list[int]] = [[] for _ in requests]
        rows = list(range(len(requests)))
        start = time.perf_counter()
        for i, token in enumerate(self._argmax_last(input_ids, slices, requests, rows, proposals)):
            proposals[i].append(token)
        steady = len(input_ids) <= 2 * len(requests)  # no prompt caught up
        seconds, passes = (time.perf_counter() - start, 1) if steady else (0.0, 0)
        for j in range(1, max(k for _, k in requests)):
            start = time.perf_counter()
            rows = [i for i, (_, k) in enumerate(requests) if k > j]
            slices = []
            for i in rows:
                request = requests[i][0]
                slices.append(SequenceSlice(len(request.token_ids) + j - 1, 1, request.block_ids))
                request.num_draft_computed_tokens += 1
            tokens = self._argmax_last(
                [proposals[i][-1] for i in rows], slices, requests, rows, proposals
            )
            for i, token in zip(rows, tokens, strict=True):
                proposals[i].append(token)
            seconds, passes = seconds + time.perf_counter() - start, passes + 1
        self.priced = (seconds, passes)
        return proposals

    def _argmax_last(self, input_ids, slices, requests, rows, proposals) -> list[int]:
        """One draft forward pass over `slices` (of requests[rows]); the processed argmax
        after each slice's last token."""
        positions, meta = build_attention_metadata(slices, self.kv_cache.block_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, positions, self.kv_cache, meta)
        last = torch.tensor(
            [end - 1 for end in meta.query_start_loc[1:]], dtype=torch.long, device=self.device
        )
        sampling = [
            SamplingRow(r.sampling, [*r.token_ids, *proposals[i]], r.num_prompt_tokens)
            for i, r in ((i, requests[i][0]) for i in rows)
        ]
        logits = process_logits(self.model.compute_logits(hidden[last]), sampling)
        return logits.argmax(dim=-1).tolist()
