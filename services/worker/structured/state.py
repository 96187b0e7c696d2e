"""A worker's structured-output state across steps (issue 17, work in progress): the
grammar cache (built on first use from the model's tokenizer) and one matcher per
constrained request, started when the request first samples on this worker (replaying the
tokens it generated elsewhere), masked before each of its samples and advanced by each
sampled token, forgotten when the request leaves the batch."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from common.grammar_cache import GrammarCache
from services.worker.structured.matchers import RequestMatchers


class StructuredOutputs:
    def __init__(self, tokenizer_folder: str, vocab_size: int) -> None:
        self._folder = tokenizer_folder
        self._vocab_size = vocab_size
        self._cache: GrammarCache | None = None
        self.matchers = RequestMatchers(vocab_size)

    def _grammars(self) -> GrammarCache:
        if self._cache is None:
            from common.hf_checkpoint_reader import load_tokenizer

            self._cache = GrammarCache(load_tokenizer(self._folder), self._vocab_size)
        return self._cache

    def mask(self, logits: torch.Tensor, requests: Sequence) -> None:
        """`requests[k]`: the request sampled from logits row k (`WorkerRequest`)."""
        rows = []
        for k, request in enumerate(requests):
            if request.structured is None:
                continue
            if request.request_id not in self.matchers:
                compiled = self._grammars().compile(request.structured)
                generated = request.token_ids[request.num_prompt_tokens :]
                self.matchers.start(request.request_id, compiled, generated)
            if self.matchers.terminated(request.request_id):
                # It sampled its stop token last step; with async scheduling one more step
                # was planned before the scheduler saw it, and that token is dropped there.
                continue
            rows.append((k, request.request_id))
        self.matchers.mask(logits, rows)

    def accept(self, requests: Sequence, tokens: Sequence[int]) -> None:
        for request, token in zip(requests, tokens, strict=False):
            rid = request.request_id
            if request.structured is None or rid not in self.matchers:
                continue
            if not self.matchers.terminated(rid):
                self.matchers.accept(rid, token)

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.matchers.drop(request_id)

    def reset(self) -> None:
        """A new step stream: every request is gone."""
        self.matchers = RequestMatchers(self._vocab_size)
