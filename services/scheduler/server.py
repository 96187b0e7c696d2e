"""SchedulerService servicer: protobuf in, engine calls, protobuf out; domain errors become
gRPC status codes."""

from __future__ import annotations

import grpc

from common.log import bind_request
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc, types_pb2
from services.scheduler.engine import Engine, InvalidRequestError
from services.scheduler.handle import Finished
from services.scheduler.pool import Pool
from services.scheduler.request import FinishReason, Request, SamplingParams
from services.scheduler.worker_client import ROLE_FROM_PB, WorkerUnavailableError

FINISH_TO_PB = {
    FinishReason.STOP: types_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: types_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: types_pb2.FINISH_REASON_ABORT,
}
ROLE_TO_PB = {role: pb for pb, role in ROLE_FROM_PB.items()}


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.model: types_pb2.ModelDescription | None = None

    async def _ready(self, context) -> Engine:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is connecting to workers")
        return self.engine

    async def Submit(self, request, context):
        engine = await self._ready(context)
        with bind_request(request.request_id):
            try:
                sampling = SamplingParams(
                    temperature=request.sampling.temperature,
                    top_p=request.sampling.top_p or 1.0,
                    top_k=request.sampling.top_k,
                )
                handle = engine.submit(
                    Request(
                        request_id=request.request_id,
                        prompt_token_ids=list(request.prompt_token_ids),
                        max_tokens=request.max_tokens,
                        sampling=sampling,
                        stop_token_ids=frozenset(request.stop_token_ids),
                        cache_salt=request.cache_salt,
                        max_model_len=engine.max_model_len,
                    )
                )
            except (InvalidRequestError, ValueError) as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except WorkerUnavailableError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            try:
                while True:
                    events = [await handle.events.get()]
                    while not handle.events.empty():  # coalesce what piled up
                        events.append(handle.events.get_nowait())
                    tokens = [t for e in events if isinstance(e, list) for t in e]
                    finished = next((e for e in events if isinstance(e, Finished)), None)
                    if finished is None:
                        yield scheduler_pb2.SubmitResponse(token_ids=tokens)
                        continue
                    if finished.error is not None:
                        code, message = finished.error
                        await context.abort(grpc.StatusCode[code], message)
                    yield scheduler_pb2.SubmitResponse(
                        token_ids=tokens,
                        finish_reason=FINISH_TO_PB[finished.reason],
                        usage=types_pb2.Usage(
                            prompt_tokens=finished.prompt_tokens,
                            completion_tokens=finished.completion_tokens,
                            cached_tokens=finished.cached_tokens,
                        ),
                    )
                    return
            finally:
                if not handle.done:  # the caller went away (cancel, deadline, disconnect)
                    engine.abort(request.request_id)

    async def Abort(self, request, context):
        engine = await self._ready(context)
        return scheduler_pb2.AbortResponse(found=engine.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        await self._ready(context)
        return scheduler_pb2.GetModelInfoResponse(model=self.model)

    async def GetPoolStats(self, request, context):
        engine = await self._ready(context)
        return scheduler_pb2.GetPoolStatsResponse(
            pools=[pool_stats(p) for p in engine.pools],
            num_requests=engine.num_requests,
            integrity_errors=engine.check_integrity() if request.check_integrity else [],
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
        kv_blocks_received=counters.kv_blocks_received,
        kv_blocks_reused=counters.kv_blocks_reused,
        steps=counters.steps,
        mean_execute_ms=counters.mean_execute_ms,
        mean_step_interval_ms=counters.mean_step_interval_ms,
        num_swap_blocks=0 if swap is None else swap.num_blocks,
        num_free_swap_blocks=0 if swap is None else swap.num_free_blocks,
    )
