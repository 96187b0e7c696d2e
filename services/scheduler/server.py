"""SchedulerService servicer: protobuf in, engine calls, protobuf out; domain errors become
gRPC status codes."""

from __future__ import annotations

import grpc

from common.log import bind_request
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc, types_pb2
from services.scheduler.engine import Engine, InvalidRequestError, OverloadedError
from services.scheduler.handle import Tokens
from services.scheduler.pool import Pool
from services.scheduler.request import FinishReason, Logprob, Request, SamplingParams
from services.scheduler.worker_client import ROLE_FROM_PB, WorkerUnavailableError

FINISH_TO_PB = {
    FinishReason.STOP: types_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: types_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: types_pb2.FINISH_REASON_ABORT,
}
ROLE_TO_PB = {role: pb for pb, role in ROLE_FROM_PB.items()}
MAX_SAMPLES = 16


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.model: types_pb2.ModelDescription | None = None
        # Client request id -> its samples' request ids, while its Submit stream is open.
        self._groups: dict[str, list[str]] = {}
        # Set on SIGTERM: running requests finish, new ones get UNAVAILABLE.
        self.draining = False

    async def _ready(self, context) -> Engine:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is connecting to workers")
        return self.engine

    async def Submit(self, request, context):
        engine = await self._ready(context)
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is shutting down")
        with bind_request(request.request_id):
            try:
                samples = samples_from_pb(request, engine.max_model_len)
                handles = engine.submit(samples)
            except (InvalidRequestError, ValueError) as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except OverloadedError as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except WorkerUnavailableError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            self._groups[request.request_id] = [s.request_id for s in samples]
            events = handles[0].events
            unfinished = len(handles)
            try:
                while unfinished:
                    batch = [await events.get()]
                    while not events.empty():  # coalesce what piled up
                        batch.append(events.get_nowait())
                    for message, error in responses_from_events(batch):
                        if error is not None:
                            await context.abort(grpc.StatusCode[error[0]], error[1])
                        unfinished -= message.finish_reason != types_pb2.FINISH_REASON_UNSPECIFIED
                        yield message
            finally:
                self._groups.pop(request.request_id, None)
                for handle in handles:
                    if not handle.done:  # the caller went away (cancel, deadline, disconnect)
                        engine.abort(handle.request.request_id)

    async def Abort(self, request, context):
        engine = await self._ready(context)
        ids = self._groups.get(request.request_id, [request.request_id])
        if request.HasField("index"):
            ids = ids[request.index : request.index + 1]
        found = [engine.abort(i) for i in ids]
        return scheduler_pb2.AbortResponse(found=any(found))

    async def GetModelInfo(self, request, context):
        await self._ready(context)
        return scheduler_pb2.GetModelInfoResponse(model=self.model)

    async def GetPoolStats(self, request, context):
        engine = await self._ready(context)
        waiting_requests, waiting_tokens = engine.num_waiting
        return scheduler_pb2.GetPoolStatsResponse(
            pools=[pool_stats(p) for p in engine.pools],
            num_requests=engine.num_requests,
            integrity_errors=engine.check_integrity() if request.check_integrity else [],
            num_waiting_requests=waiting_requests,
            num_waiting_tokens=waiting_tokens,
            rejected_requests=engine.num_rejected_requests,
            worker_failures=engine.num_worker_failures,
            restarted_requests=engine.num_restarted_requests,
        )


def pool_stats(pool: Pool) -> scheduler_pb2.PoolStats:
    blocks, swap, counters = pool.blocks, pool.scheduler.swap_blocks, pool.counters
    return scheduler_pb2.PoolStats(
        worker_id=pool.info.worker_id,
        role=ROLE_TO_PB[pool.info.role],
        address=pool.info.address,
        num_blocks=blocks.num_blocks,
        num_free_blocks=blocks.num_free_blocks,
        num_requests=blocks.num_requests,
        num_cached_blocks=blocks.pool.num_cached,
        prefix_hit_tokens=pool.scheduler.num_prefix_hit_tokens,
        evictions=blocks.pool.num_evictions,
        preemptions=pool.scheduler.num_preemptions,
        swap_outs=pool.scheduler.num_swap_outs,
        healthy=pool.healthy,
        draining=pool.draining,
        kv_blocks_received=counters.kv_blocks_received,
        kv_blocks_reused=counters.kv_blocks_reused,
        steps=counters.steps,
        mean_execute_ms=counters.mean_execute_ms,
        mean_step_interval_ms=counters.mean_step_interval_ms,
        mean_step_overhead_ms=counters.mean_step_overhead_ms,
        num_swap_blocks=0 if swap is None else swap.num_blocks,
        num_free_swap_blocks=0 if swap is None else swap.num_free_blocks,
    )


def sampling_from_pb(
    pb: types_pb2.SamplingParams, seed_offset: int, with_prompt_logprobs: bool
) -> SamplingParams:
    return SamplingParams(
        temperature=pb.temperature,
        top_p=pb.top_p or 1.0,
        top_k=pb.top_k,
        min_p=pb.min_p,
        repetition_penalty=pb.repetition_penalty or 1.0,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        logit_bias=tuple(sorted(pb.logit_bias.items())),
        seed=(pb.seed + seed_offset) % 2**64 if pb.HasField("seed") else None,
        min_tokens=pb.min_tokens,
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        prompt_logprobs=(
            pb.prompt_logprobs if with_prompt_logprobs and pb.HasField("prompt_logprobs") else None
        ),
    )


def samples_from_pb(request: scheduler_pb2.SubmitRequest, max_model_len: int) -> list[Request]:
    """The n samples of a SubmitRequest as separate requests (sample i: seed + i; only
    sample 0 computes prompt logprobs)."""
    n = request.n or 1
    if not 1 <= n <= MAX_SAMPLES:
        raise InvalidRequestError(f"n must be in 1..{MAX_SAMPLES}, got {n}")
    samples = [
        Request(
            request_id=request.request_id if n == 1 else f"{request.request_id}/{i}",
            prompt_token_ids=list(request.prompt_token_ids),
            max_tokens=request.max_tokens,
            sampling=sampling_from_pb(request.sampling, i, with_prompt_logprobs=i == 0),
            stop_token_ids=frozenset(request.stop_token_ids),
            cache_salt=request.cache_salt,
            max_model_len=max_model_len,
            index=i,
        )
        for i in range(n)
    ]
    for sample in samples[1:]:
        sample.leader = samples[0]
    return samples


def logprob_pb(logprob: Logprob) -> types_pb2.TokenLogprob:
    return types_pb2.TokenLogprob(
        token_id=logprob.token_id,
        logprob=logprob.logprob,
        top_logprobs=[types_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in logprob.top],
    )


def responses_from_events(events: list) -> list[tuple[scheduler_pb2.SubmitResponse, tuple | None]]:
    """One SubmitResponse per run of same-sample events (tokens merged); a Finished closes
    its sample's message. Returns (message, error) pairs; error = (status name, text)."""
    out: list[list] = []  # [message, error]
    open_entries: dict[int, list] = {}
    for event in events:
        entry = open_entries.get(event.index)
        if entry is None:
            entry = open_entries[event.index] = [
                scheduler_pb2.SubmitResponse(index=event.index),
                None,
            ]
            out.append(entry)
        message = entry[0]
        if isinstance(event, Tokens):
            message.token_ids.extend(event.token_ids)
            message.logprobs.extend(logprob_pb(lp) for lp in event.logprobs)
            message.prompt_logprobs.extend(logprob_pb(lp) for lp in event.prompt_logprobs)
            if event.cached_tokens is not None:
                message.cached_tokens = event.cached_tokens
            continue
        message.finish_reason = FINISH_TO_PB[event.reason]
        message.usage.CopyFrom(
            types_pb2.Usage(
                prompt_tokens=event.prompt_tokens,
                completion_tokens=event.completion_tokens,
                cached_tokens=event.cached_tokens,
            )
        )
        entry[1] = event.error
        del open_entries[event.index]
    return [(message, error) for message, error in out]
