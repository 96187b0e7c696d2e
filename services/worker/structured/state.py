"""A worker's structured-output state across steps: the compiled grammars and one matcher
per constrained request.

Compiling happens on a grammar thread of its own (xgrammar's import and the tokenizer load
included, ~3 s the first time), never on the tensor thread unless a step needs a grammar
nobody prepared: the scheduler asks every worker to `prepare` a new constraint before it
schedules the request, so a slow schema stalls only the requests that wait for it. A
matcher starts when its request first samples on this worker (replaying the tokens it
generated elsewhere), masks each of its samples and is advanced by each sampled token, and
is forgotten when the request leaves the batch."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from common.grammar_cache import GrammarCache
from common.structured_output import Constraint
from services.worker.structured.matchers import RequestMatchers

MAX_COMPILED = 512  # distinct constraints kept compiled (least recently used leave first)


class StructuredOutputs:
    def __init__(self, tokenizer_folder: str, vocab_size: int, any_whitespace: bool = True) -> None:
        self._folder = tokenizer_folder
        self._vocab_size = vocab_size
        self._any_whitespace = any_whitespace  # JSON's whitespace (common/grammar_cache.py)
        self._cache: GrammarCache | None = None
        self._compiled: OrderedDict[Constraint, object] = OrderedDict()
        self._lock = threading.Lock()  # _compiled is read by the tensor thread
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._matchers: RequestMatchers | None = None

    # -- compiling (grammar thread) -------------------------------------------------------
    def prepare(self, constraint: Constraint) -> concurrent.futures.Future:
        """Compile `constraint` on the grammar thread; the future's result is the seconds it
        took (0 when it was compiled already), or ConstraintError naming the problem."""
        return self._thread.submit(self._timed_compile, constraint)

    def _timed_compile(self, constraint: Constraint) -> float:
        start = time.perf_counter()
        self._compile(constraint)
        return time.perf_counter() - start

    def _compile(self, constraint: Constraint):
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is not None:
                self._compiled.move_to_end(constraint)
                return compiled
        if self._cache is None:
            from common.hf_checkpoint_reader import load_tokenizer

            self._cache = GrammarCache(
                load_tokenizer(self._folder), self._vocab_size, any_whitespace=self._any_whitespace
            )
        compiled = self._cache.compile(constraint)
        with self._lock:
            self._compiled[constraint] = compiled
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def _compiled_for(self, constraint: Constraint):
        with self._lock:
            compiled = self._compiled.get(constraint)
        if compiled is not None:
            return compiled
        return self._thread.submit(self._compile, constraint).result()  # nobody prepared it

    # -- per step (tensor thread) ---------------------------------------------------------
    def mask(self, logits: torch.Tensor, requests: Sequence) -> None:
        """`requests[k]`: the request sampled from logits row k (`WorkerRequest`)."""
        rows = []
        for k, request in enumerate(requests):
            if request.structured is None:
                continue
            matchers = self._request_matchers()
            if request.request_id not in matchers:
                compiled = self._compiled_for(request.structured)
                generated = request.token_ids[request.num_prompt_tokens :]
                matchers.start(request.request_id, compiled, generated)
            if matchers.terminated(request.request_id):
                # It sampled its stop token last step; with async scheduling one more step
                # was planned before the scheduler saw it, and that token is dropped there.
                continue
            rows.append((k, request.request_id))
        if rows:
            self._matchers.mask(logits, rows)

    def _request_matchers(self) -> RequestMatchers:
        if self._matchers is None:
            self._matchers = RequestMatchers(self._vocab_size)
        return self._matchers

    def accept(self, requests: Sequence, tokens: Sequence[int]) -> None:
        matchers = self._matchers
        if matchers is None:
            return
        for request, token in zip(requests, tokens, strict=False):
            rid = request.request_id
            if request.structured is None or rid not in matchers:
                continue
            if not matchers.terminated(rid):
                matchers.accept(rid, token)

    def forget(self, request_ids: Iterable[str]) -> None:
        if self._matchers is not None:
            for request_id in request_ids:
                self._matchers.drop(request_id)

    def reset(self) -> None:
        """A new step stream: every request is gone."""
        if self._matchers is not None:
            self._matchers = RequestMatchers(self._vocab_size)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
