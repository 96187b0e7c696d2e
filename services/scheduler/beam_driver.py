"""Beam search above the engine, as vLLM V1 runs it in its front end: a driver that submits
and cancels ordinary requests (the policy is `beam_search.py`).

Each step of a search is one request per live beam, each computing one token and finishing,
greedy with the policy's `candidates_needed()` raw logprobs: their logprobs are the beams'
candidates, their greedy picks are never used. They keep their KV when they finish
(`Request.keep_kv`: parked where they decode; a prompt run in a prefill pool is handed to a
decode pool first). The prompt is the first step's one request. When every beam's request
has parked, the policy steps and each new beam is a request forked from its parent's
(`Engine.fork`: the parent's blocks shared by reference count, a shared partial block
copied on write when the child writes into it), whose tokens are its parent's chosen
tokens plus the new one and whose computed tokens are its parent's, so it computes only
its new token; then the parents are released (`Engine.release_kv`). When the search is
done the best `n` hypotheses go out whole (index 0 the best), then the request ends; a
search that asked for `kv_retention_s` first has the blocks of its prompt and of those
hypotheses retained where its last beams are parked (`Engine.retain_kv`: found by their
hashes, so a hypothesis that finished steps ago is kept too), as a finished request's
are; blocks that only pruned beams held are not (the beams' own requests retain nothing).

A search that loses a beam's KV (preempted, swapped out, its worker failed or its
transfer did: its requests are not `restartable`, so they end with ABORTED instead of
starting over) starts over from its prompt, up to `MAX_BEAM_RESTARTS` times: the search is
deterministic and nothing was sent yet. Its requests are parts of one client request
(`Request.counted`): the driver reports the search's times and its finish once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from common.log import bind_request, get_logger
from services.scheduler.beam_search import BeamParams, BeamSearch
from services.scheduler.handle import Finished, Tokens
from services.scheduler.request import FinishReason, Request
from services.scheduler.request_trace import RequestTrace

log = get_logger(__name__)

EARLY_STOPPING = {"": False, "false": False, "true": True, "never": "never"}
# Restarts after a lost beam (preemption, swap-out) before the request fails: a pool too
# small for beam_width beams would otherwise restart it forever.
MAX_BEAM_RESTARTS = 8
LOST = "ABORTED"  # the error code of a request that lost its KV (`Engine._lose`)


class _Sink:
    """One of the search's requests' events, tagged with its id, into the search's queue."""

    def __init__(self, queue: asyncio.Queue, request_id: str) -> None:
        self._queue, self._request_id = queue, request_id

    def put_nowait(self, event) -> None:
        self._queue.put_nowait((self._request_id, event))


class BeamDriver:
    """One client request's beam search (module docstring). `template`: its prompt,
    settings and limits (`server.beam_template_from_pb`); `events`: the client's."""

    def __init__(
        self,
        engine,
        template: Request,
        params: BeamParams,
        events,
        trace: RequestTrace | None = None,
    ) -> None:
        self.engine, self.template, self.params = engine, template, params
        self.events, self.trace = events, trace
        self.request_id = template.request_id
        self.num_restarts = 0
        self.done = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._attempt = 0
        self._search = BeamSearch(params)
        self._beams: list[str] = []  # this step's requests, in the policy's order
        self._candidates: dict[str, tuple[tuple[int, float], ...]] = {}
        self._parked: set[str] = set()
        self._live: set[str] = set()  # this attempt's requests the engine holds
        self._prompt: Request | None = None
        self._first_prompt: Request | None = None  # the search's times are its run's
        self._task: asyncio.Task | None = None

    # -- public ---------------------------------------------------------------------------
    def start(self) -> None:
        """Submit the prompt (raising what `Engine.submit` raises) and run the search."""
        self.engine.validate(self.template)  # the whole search's limits, before anything
        self._submit_prompt()
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"beam-{self.request_id}"
        )

    def abort(self) -> None:
        """The client cancelled: release everything; each result ends ABORT."""
        if not self.done:
            self._end(FinishReason.ABORT, None)

    # -- the search -----------------------------------------------------------------------
    async def _run(self) -> None:
        while not self.done:
            request_id, event = await self._queue.get()
            try:
                self._on_event(request_id, event)
            except Exception as exc:  # a bug: this search fails, nothing else
                log.exception("beam_search_failed", request_id=self.request_id)
                self._end(FinishReason.ABORT, ("INTERNAL", f"request failed: {exc!r}"))

    def _submit_prompt(self) -> None:
        self._attempt += 1
        self._search = BeamSearch(self.params)
        self._beams, self._candidates, self._parked = [], {}, set()
        prompt = dataclasses.replace(
            self.template,
            request_id=self._id("0"),
            max_tokens=1,
            max_model_len=None,
            output_token_ids=[],
            block_hashes=[],
            keep_kv=True,
            restartable=False,
            counted=False,
        )
        rid = prompt.request_id
        # Traced as the client request (its workers' spans too); the beams are not (a span
        # per beam per token), and the span ends with the search (`_end`).
        self.engine.submit([prompt], events=_Sink(self._queue, rid), trace=self.trace)
        self._prompt, self._beams, self._live = prompt, [rid], {rid}
        self._first_prompt = self._first_prompt or prompt

    def _on_event(self, request_id: str, event) -> None:
        if request_id not in self._live:
            return  # an earlier attempt's, or a released request's
        if isinstance(event, Tokens):
            if event.logprobs:
                self._candidates[request_id] = tuple(event.logprobs[-1].top)
            return
        if event.error is not None:
            self._live.discard(request_id)
            if event.error[0] == LOST:
                self._restart(event.error[1])
            else:
                self._end(FinishReason.ABORT, event.error)
            return
        self._parked.add(request_id)
        if self._parked.issuperset(self._beams) and self._candidates.keys() >= set(self._beams):
            self._step()

    def _step(self) -> None:
        parents = self._beams
        result = self._search.step([self._candidates[rid] for rid in parents])
        self._candidates, self._parked = {}, set()
        if result.done:
            self._end(None, None)
            return
        step = self._search.num_steps
        children: list[str] = []
        try:
            for i, (fork, beam) in enumerate(
                zip(result.forks, self._search.live_beams, strict=True)
            ):
                child = self._beam_request(beam.tokens, f"{step}.{i}")
                sink = _Sink(self._queue, child.request_id)
                self.engine.fork(parents[fork.parent_index], child, sink)
                self._live.add(child.request_id)
                children.append(child.request_id)
        except KeyError as exc:  # a parent's KV is gone (its worker failed meanwhile)
            self._restart(str(exc))  # releases every live request, children included
            return
        for parent in parents:
            self._live.discard(parent)
            self.engine.release_kv(parent)
        self._beams = children

    def _beam_request(self, tokens: tuple[int, ...], name: str) -> Request:
        """A new beam: its parent's chosen tokens and the new one; it computes that one and
        finishes (the policy owns EOS and length: no stop tokens, no context limit)."""
        template = self.template
        return dataclasses.replace(
            template,
            request_id=self._id(name),
            max_tokens=len(tokens) + 1,
            max_model_len=None,
            output_token_ids=list(tokens),
            num_computed_tokens=len(template.prompt_token_ids) + len(tokens) - 1,
            num_cached_tokens=max(0, self._prompt.num_cached_tokens),
            block_hashes=[],
            prompt_logprobs=[],
            trace_context=("", ""),
            kv_retention_s=0.0,  # what is kept is chosen at the end (`_retain`)
            keep_kv=True,
            restartable=False,
            counted=False,
        )

    def _id(self, name: str) -> str:
        """`<id>#0` for the prompt, `<id>#<step>.<beam>` for a beam; `<id>~<attempt>#...`
        after a restart (an earlier attempt's late events never match)."""
        base = self.request_id if self._attempt == 1 else f"{self.request_id}~{self._attempt}"
        return f"{base}#{name}"

    def _release_all(self) -> None:
        """Free every request of this attempt (running ones are aborted; their late
        events are ignored). A failure here is logged, never raised: the client's results
        must still go out."""
        for request_id in list(self._live):
            try:
                self.engine.release_kv(request_id)  # parked: freed (else nothing)
                self.engine.abort(request_id)  # running: ended (else nothing)
            except Exception:
                log.exception("beam_release_failed", request_id=request_id)
        self._live = set()

    def _restart(self, why: str) -> None:
        self._release_all()
        if self.num_restarts >= MAX_BEAM_RESTARTS:
            self._end(
                FinishReason.ABORT,
                (
                    "RESOURCE_EXHAUSTED",
                    f"beam search lost a beam {self.num_restarts + 1} times ({why}): the KV "
                    f"pool cannot hold {self.params.beam_width} beams next to the other "
                    "requests; retry later or with a smaller beam_width",
                ),
            )
            return
        self.num_restarts += 1
        self.engine.count_restart()
        with bind_request(self.request_id, self.template.trace_id):
            log.info("beam_search_restarted", reason=why, restarts=self.num_restarts)
        try:
            self._submit_prompt()
        except Exception as exc:  # no worker left, overloaded: the search ends
            self._end(FinishReason.ABORT, ("UNAVAILABLE", f"beam search restart failed: {exc}"))

    def _end(self, reason: FinishReason | None, error: tuple[str, str] | None) -> None:
        """Release everything and send the results (`reason` None: the best hypotheses,
        whole), or end each result with `reason` and `error`."""
        if self.done:
            return
        self.done = True
        results = self._search.results() if reason is None else []
        if results and self.template.kv_retention_s > 0:
            self._retain(results[: self.params.num_return_sequences])
        self._release_all()
        summary = self._summary()
        cached = max(0, summary.num_cached_tokens)
        eos = set(self.params.eos_token_ids)
        for index in range(self.params.num_return_sequences):
            tokens = list(results[index].tokens) if results else []
            why = reason or (FinishReason.STOP if tokens[-1:] and tokens[-1] in eos else
                             FinishReason.LENGTH)  # fmt: skip
            if results:
                self.events.put_nowait(Tokens(index, tokens, cached_tokens=cached))
            self.events.put_nowait(
                Finished(
                    index=index, reason=why, prompt_tokens=len(summary.prompt_token_ids),
                    completion_tokens=len(tokens), cached_tokens=cached, error=error,
                    beam_score=results[index].score if results else None,
                )
            )  # fmt: skip
            if index == 0:
                summary.finish_reason, summary.output_token_ids = why, tokens
        now = time.monotonic()
        if self.trace is not None:
            self.trace.sample_finished(summary, error)
        if self.engine.on_finish is not None:  # metrics: the search's times, as one request
            self.engine.on_finish(summary, now)
        with bind_request(self.request_id, self.template.trace_id):
            log.info(
                "request_finished",
                finish_reason=summary.finish_reason.value,
                prompt_tokens=len(summary.prompt_token_ids),
                output_tokens=sum(len(h.tokens) for h in results),
                cached_tokens=cached,
                beam_width=self.params.beam_width,
                beam_steps=self._search.num_steps,
                beam_restarts=self.num_restarts,
                error=error[1] if error else None,
            )

    def _retain(self, hypotheses) -> None:
        """Keep the prompt's and the returned hypotheses' KV for the search's
        `kv_retention_s` (before the last beams are released). A hypothesis's last token
        was chosen from its parent's candidates, never computed: its KV is its other
        tokens'. A failure is logged, never raised: the results must still go out."""
        prompt = self.template.prompt_token_ids
        sequences = [
            dataclasses.replace(
                self.template,
                request_id=self._id(f"kept.{i}"),
                output_token_ids=list(h.tokens),
                num_computed_tokens=len(prompt) + len(h.tokens) - 1,
                block_hashes=[],
            )
            for i, h in enumerate(hypotheses)
        ]
        try:
            self.engine.retain_kv(sorted(self._live), sequences)
        except Exception:
            log.exception("beam_retain_failed", request_id=self.request_id)

    def _summary(self) -> Request:
        """The search as one request (its times are its first prompt run's)."""
        summary = dataclasses.replace(self.template, output_token_ids=[])
        if self._first_prompt is not None:
            prompt = self._first_prompt
            summary.first_scheduled_time = prompt.first_scheduled_time
            summary.first_token_time = prompt.first_token_time
            summary.num_cached_tokens = prompt.num_cached_tokens
        return summary
