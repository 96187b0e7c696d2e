"""Beam search in the scheduler, on paged KV: one client request's `BeamSearch` (the policy,
`beam_search.py`) and the scheduler `Request`s of its live beams.

The prompt runs as one request, the group's *leader*, like any other (prefill pool, hand-off,
prefix cache), greedy with `candidates_needed()` raw logprobs per sampled token. Every later
step each live beam is a request that computes its last token; the worker's greedy pick is
appended to it as to any request but never used: the beam's logprobs are its candidates.
When every live beam's candidates are in (a beam whose are in is `held`: not scheduled),
the policy steps and each new beam becomes a NEW request (`<id>#<step>.<i>`) whose tokens
are its parent's chosen tokens plus the new one, whose blocks are its parent's
(`BlockManager.fork`: shared by reference count) and whose computed tokens are its
parent's, so only the new token is computed next; a shared partial block is copied on
write when a beam writes into it (`BlockManager.allocate(write_from=...)`, `block_copies`
in the plan). The old beams are released at once (blocks freed, dropped from the worker),
finished and pruned ones included; the new ones join the pool's queue at its front and run
in the same batches as any request. The worker sees each new beam as a new request with
its full token ids and block table, so its persistent batch needs nothing new. When the
search is done the best `n` hypotheses go out whole (index 0 the best), then the request
ends. A beam search that loses a beam (preempted, swapped out, its worker failed or
draining) starts over from its prompt: the search is deterministic and nothing was sent yet.

`BeamGroup` is the bookkeeping (pure); `BeamSteps` is the engine's part (a mixin of
`Engine`, like `Recovery`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.log import bind_request, get_logger
from services.scheduler.beam_search import BeamParams, BeamSearch
from services.scheduler.block_manager import BlockManager
from services.scheduler.handle import Finished, RequestHandle, Tokens
from services.scheduler.request import FinishReason, Request

log = get_logger(__name__)

EARLY_STOPPING = {"": False, "false": False, "true": True, "never": "never"}
# Restarts after a lost beam (preemption, swap-out) before the request fails: a pool too
# small for beam_width beams would otherwise restart it forever.
MAX_BEAM_RESTARTS = 8


@dataclass(frozen=True)
class BeamResult:
    tokens: tuple[int, ...]
    score: float
    reason: FinishReason  # STOP when it ends with an EOS, LENGTH otherwise


@dataclass(eq=False)
class BeamGroup:
    leader: Request
    params: BeamParams
    search: BeamSearch = field(init=False)
    # The live beams' requests, in the policy's order (empty before the first step).
    beams: list[Request] = field(default_factory=list)
    # The leader's candidates for the first step, until the leader is where it decodes.
    first: tuple[tuple[int, float], ...] | None = None
    # Candidates in for this step, by beam request id.
    candidates: dict[str, Sequence[tuple[int, float]]] = field(default_factory=dict)
    num_restarts: int = 0

    def __post_init__(self) -> None:
        self.search = BeamSearch(self.params)
        self.leader.beam = self

    def record(self, request: Request, top: Sequence[tuple[int, float]], scheduler) -> bool:
        """A live beam's candidates (its step's top logprobs) are in; True when every live
        beam's are. The leader's are the first step's. Stale ones (a released beam) are
        ignored. A beam whose candidates are in leaves its pool's queues and the worker's
        batch, keeping its blocks until the step (so it never takes a batch slot another
        beam of its group waits for: max_num_seqs below the width cannot stall it)."""
        if request is self.leader:
            self.first = tuple(top)
            return True
        if not any(b is request for b in self.beams):
            return False
        self.candidates[request.request_id] = tuple(top)
        request.held = True
        scheduler.detach(request)
        return len(self.candidates) == len(self.beams)

    def step(self, blocks: BlockManager) -> tuple[list[Request], list[Request], bool]:
        """Run the policy on the candidates in: (new beams, old beams to release, done). The
        new beams already share their parents' blocks in `blocks`."""
        parents = self.beams or [self.leader]
        if self.beams:
            per_beam = [self.candidates[b.request_id] for b in self.beams]
        else:
            if self.first is None:
                raise RuntimeError(f"{self.leader.request_id}: no first-step candidates")
            per_beam = [self.first]
        result = self.search.step(per_beam)
        self.candidates, self.first = {}, None
        children: list[Request] = []
        for i, (fork, beam) in enumerate(zip(result.forks, self.search.live_beams, strict=True)):
            parent = parents[fork.parent_index]
            child = self._new_beam(beam.tokens, i, blocks.block_size)
            if parent.num_computed_tokens != child.num_computed_tokens or not blocks.has(
                parent.request_id
            ):
                raise RuntimeError(
                    f"beam {parent.request_id}: {parent.num_computed_tokens} tokens computed, "
                    f"its child needs {child.num_computed_tokens}"
                )
            blocks.fork(parent.request_id, child.request_id)
            children.append(child)
        for parent in parents:
            parent.held = False
        self.beams = children
        return children, parents, result.done

    def _new_beam(self, tokens: tuple[int, ...], i: int, block_size: int) -> Request:
        leader, p = self.leader, self.params
        prompt = leader.prompt_token_ids
        return Request(
            request_id=f"{leader.request_id}#{self.search.num_steps}.{i}",
            prompt_token_ids=prompt,
            # One more than the policy gives it: the worker's pick never ends it (the
            # policy owns EOS and length; it has no stop tokens and no context limit).
            max_tokens=p.max_new_tokens + 1,
            sampling=leader.sampling,
            cache_salt=leader.cache_salt,
            lora_name=leader.lora_name,
            beam=self,
            output_token_ids=list(tokens),
            num_computed_tokens=len(prompt) + len(tokens) - 1,
            num_cached_tokens=max(0, leader.num_cached_tokens),
            hash_root=leader.hash_root,
            # The prompt's full blocks (the leader's later hashes may cover its worker pick).
            block_hashes=list(leader.block_hashes[: len(prompt) // block_size]),
            arrival_time=leader.arrival_time,
            first_token_time=leader.first_token_time,
        )

    def release(self, scheduler, request: Request) -> None:
        """Free a beam (or the leader) in its pool; a beam's late results are dropped."""
        request.held = False
        if request is not self.leader and request.finish_reason is None:
            request.finish_reason = FinishReason.ABORT
        scheduler.release(request)

    def reset(self, scheduler) -> None:
        """Release every live beam and start the search over (the leader recomputes)."""
        for beam in self.beams:
            self.release(scheduler, beam)
        self.beams, self.candidates, self.first = [], {}, None
        self.search = BeamSearch(self.params)
        self.leader.output_token_ids.clear()
        self.leader.held = False

    def results(self) -> list[BeamResult]:
        eos = set(self.params.eos_token_ids)
        return [
            BeamResult(
                h.tokens,
                h.score,
                FinishReason.STOP if h.tokens and h.tokens[-1] in eos else FinishReason.LENGTH,
            )
            for h in self.search.results()
        ]


class BeamSteps:
    """The engine's side of beam search (a mixin of `Engine`)."""

    def _beam_token(self, pool, item) -> None:
        """A step's result for a beam request (`item`: a SampledToken)."""
        request = item.request
        group = request.beam
        top = item.logprob.top if item.logprob is not None else ()
        if not group.record(request, top, pool.scheduler):
            return
        if request is group.leader and not (pool.scheduler.runs_decodes or request.is_finished):
            return  # a prefill pool: the first step runs where the prompt's KV arrives
        self._beam_step(group, pool)

    def _beam_arrived(self, handle: RequestHandle) -> None:
        """The hand-off moved a leader's prompt KV to a decode pool: the first step."""
        group = handle.request.beam
        if group is not None and group.first is not None and not group.beams:
            self._beam_step(group, handle.pool)

    def _beam_step(self, group: BeamGroup, pool) -> None:
        handle = self._handle_of(group.leader)
        if handle is None or handle.done:
            return
        children, parents, done = group.step(pool.blocks)
        for parent in parents:
            group.release(pool.scheduler, parent)
        if done:
            self._beam_finish(handle)
            return
        for child in reversed(children):
            pool.scheduler.add(child, front=True)
        pool.wakeup.set()

    def _beam_restarts(self, victims: Sequence[Request]) -> list[Request]:
        """Restart the groups of beams preempted or swapped out; returns the other victims."""
        others, groups = [], []
        for victim in victims:
            group = victim.beam
            if group is None or victim is group.leader:
                others.append(victim)
            elif group not in groups:
                groups.append(group)
        for group in groups:
            self._beam_restart(group, "a beam was preempted")
        return others

    def _beam_leave(self, pool) -> None:
        """A migrating (draining) pool plans nothing for its requests: its beam searches
        start over from their prompts, to be handed to a decode pool that accepts."""
        for handle in list(self._handles.values()):
            group = handle.request.beam
            if group is not None and group.beams and handle.pool is pool:
                self._beam_restart(group, "its decode worker drains")

    def _beam_restart(self, group: BeamGroup, why: str) -> None:
        handle = self._handle_of(group.leader)
        if handle is None or handle.done:
            return
        if group.num_restarts >= MAX_BEAM_RESTARTS:
            self._finish(
                handle,
                FinishReason.ABORT,
                (
                    "RESOURCE_EXHAUSTED",
                    f"beam search lost a beam {group.num_restarts + 1} times ({why}): the KV "
                    f"pool cannot hold {group.params.beam_width} beams next to the other "
                    "requests; retry later or with a smaller beam_width",
                ),
            )
            return
        self._release(handle)  # every beam freed, the search reset (Engine._release)
        leader = group.leader
        leader.num_computed_tokens = 0
        leader.num_pending_tokens = 0
        leader.num_preemptions += 1
        group.num_restarts += 1
        with bind_request(leader.request_id, leader.trace_id):
            log.info("beam_search_restarted", reason=why, restarts=group.num_restarts)
        self._requeue(handle)

    def _beam_finish(self, handle: RequestHandle) -> None:
        """The search is done: send the best hypotheses, whole, and end the request."""
        request, group = handle.request, handle.request.beam
        results, steps = group.results(), group.search.num_steps
        self._release(handle)
        handle.finish()
        if self.on_finish is not None:  # metrics: the search's times, as one request
            self.on_finish(request, time.monotonic())
        self._handles.pop(request.request_id, None)
        if handle.trace is not None:
            handle.trace.sample_finished(request, None)
        cached = max(0, request.num_cached_tokens)
        for index, result in enumerate(results):
            handle.events.put_nowait(Tokens(index, list(result.tokens), cached_tokens=cached))
            handle.events.put_nowait(
                Finished(
                    index=index,
                    reason=result.reason,
                    prompt_tokens=len(request.prompt_token_ids),
                    completion_tokens=len(result.tokens),
                    cached_tokens=cached,
                    beam_score=result.score,
                )
            )
        with bind_request(request.request_id, request.trace_id):
            log.info(
                "request_finished",
                finish_reason=results[0].reason.value,
                prompt_tokens=len(request.prompt_token_ids),
                output_tokens=sum(len(r.tokens) for r in results),
                cached_tokens=cached,
                beam_width=group.params.beam_width,
                beam_steps=steps,
                beam_restarts=group.num_restarts,
            )
