"""SchedulerService servicer: protobuf in, engine calls, protobuf out; domain errors become
gRPC status codes (or, on a session, per-request error updates)."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from common.kv_events_pb import batch_to_pb
from common.log import bind_request, get_logger
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from common.pb.tandem.v1 import generate_pb2
from common.retention import RetentionLimits
from common.sampling import MAX_BEAM_WIDTH, MAX_INTERNAL_LOGPROBS, MAX_SAMPLES, SamplingParams
from common.sampling_pb import ROLE_TO_PB, sampling_from_pb
from common.structured_output import constraint_from_pb
from services.scheduler.beam_driver import EARLY_STOPPING, BeamDriver
from services.scheduler.beam_search import BeamParams, BeamSearch
from services.scheduler.engine import Engine, InvalidRequestError, OverloadedError
from services.scheduler.kv_event_hub import KvEventHub
from services.scheduler.lora_admin import LoraAdmin
from services.scheduler.lora_registry import LoraConflictError, LoraEntry, LoraNotFoundError
from services.scheduler.pool import Pool
from services.scheduler.request import Request
from services.scheduler.request_trace import RequestTrace
from services.scheduler.session import SESSION_CLOSED, SessionState, updates_from_events
from services.scheduler.step_codec import model_to_pb
from services.scheduler.worker_types import (
    LoraRefusedError,
    ModelShape,
    WorkerUnavailableError,
)

log = get_logger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.model: ModelShape | None = None
        # Set on SIGTERM: running requests finish, new ones get UNAVAILABLE.
        self.draining = False
        self.kv_events: KvEventHub | None = None  # None: --enable-kv-cache-events off

    async def _ready(self, context) -> Engine:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is connecting to workers")
        return self.engine

    async def Session(self, request_iterator, context):
        engine = await self._ready(context)
        state = SessionState()
        reader = asyncio.ensure_future(self._read_session(engine, request_iterator, state))
        closed = False
        try:
            # After the gateway closes its side, what it submitted still runs to the end.
            while not (closed and not state.unfinished and state.queue.empty()):
                batch = state.drain(await state.queue.get())
                closed = closed or any(event is SESSION_CLOSED for _, event in batch)
                updates = updates_from_events([e for e in batch if e[1] is not SESSION_CLOSED])
                if updates:
                    yield scheduler_pb2.SessionResponse(updates=updates)
        finally:
            reader.cancel()
            aborted = state.abort_all(engine)  # the gateway went away: free it all
            # (Not context.peer(): on a call the transport already dropped, it segfaults.)
            log.info("session_ended", aborted=aborted)

    async def _read_session(self, engine: Engine, request_iterator, state: SessionState) -> None:
        try:
            async for message in request_iterator:
                action = message.WhichOneof("action")
                if action == "submit":
                    self._submit(engine, message.submit, state)
                elif action == "abort":
                    index = message.abort.index if message.abort.HasField("index") else None
                    state.abort(engine, message.abort.request_id, index)
        finally:
            state.queue.put_nowait((None, SESSION_CLOSED))

    def _submit(self, engine: Engine, request, state: SessionState) -> None:
        """Admit one request on the session, or refuse it with the status it deserves."""
        trace = RequestTrace.start(request, self.model.name if self.model else "")

        def refuse(code: str, message: str) -> None:
            state.refuse(request.request_id, code, message)
            if trace is not None:
                trace.refused(code, message)

        with bind_request(request.request_id, trace.trace_id if trace is not None else ""):
            if self.draining:
                refuse("UNAVAILABLE", "scheduler is shutting down")
                return
            if request.request_id in state.handles or request.request_id in state.searches:
                refuse(
                    "INVALID_ARGUMENT",
                    f"request_id {request.request_id!r} is already running",
                )
                return
            try:
                if request.HasField("beam_search"):
                    template, params = beam_template_from_pb(
                        request, engine.max_model_len, engine.retention
                    )
                    driver = BeamDriver(
                        engine, template, params, state.sink(request.request_id), trace
                    )
                    driver.start()
                    state.opened_search(request.request_id, driver, params.num_return_sequences)
                    return
                samples = samples_from_pb(request, engine.max_model_len, engine.retention)
                handles = engine.submit(samples, events=state.sink(request.request_id), trace=trace)
            except (InvalidRequestError, ValueError) as exc:
                refuse("INVALID_ARGUMENT", str(exc))
            except LoraNotFoundError as exc:
                refuse("NOT_FOUND", exc.args[0])
            except OverloadedError as exc:
                refuse("RESOURCE_EXHAUSTED", str(exc))
            except WorkerUnavailableError as exc:
                refuse("UNAVAILABLE", str(exc))
            except Exception as exc:  # a bug: this request fails, the session goes on
                log.exception("submit_failed")
                refuse("INTERNAL", f"submit failed: {exc!r}")
            else:
                state.opened(request.request_id, handles, max(len(handles), request.n))

    async def GetModelInfo(self, request, context):
        engine = await self._ready(context)
        model = dataclasses.replace(self.model, lora_adapters=engine.loras.names)
        return scheduler_pb2.GetModelInfoResponse(
            model=model_to_pb(model), kv_block_size=engine.pools[0].blocks.block_size
        )

    async def LoadLoraAdapter(self, request, context):
        engine = await self._ready(context)
        if not request.lora_name or not request.lora_path:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "lora_name and lora_path are required"
            )
        # Shielded: a caller that goes away must not leave the name half loaded.
        load = asyncio.ensure_future(LoraAdmin(engine).load(request.lora_name, request.lora_path))
        try:
            entry = await asyncio.shield(load)
        except LoraConflictError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except LoraRefusedError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except WorkerUnavailableError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return scheduler_pb2.LoadLoraAdapterResponse(adapter=lora_to_pb(entry))

    async def UnloadLoraAdapter(self, request, context):
        engine = await self._ready(context)
        unload = asyncio.ensure_future(LoraAdmin(engine).unload(request.lora_name))
        try:
            await asyncio.shield(unload)
        except LoraNotFoundError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, exc.args[0])
        return scheduler_pb2.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(self, request, context):
        engine = await self._ready(context)
        return scheduler_pb2.ListLoraAdaptersResponse(
            adapters=[lora_to_pb(e) for e in engine.loras.entries]
        )

    async def KvEvents(self, request, context):
        await self._ready(context)
        hub = self.kv_events
        if hub is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "KV events are off (--enable-kv-cache-events false)",
            )
        subscription = hub.subscribe()
        try:
            while True:
                batch = await subscription.next()
                yield scheduler_pb2.KvEventsResponse(batch=batch_to_pb(batch))
        finally:
            hub.unsubscribe(subscription)

    async def ResetPrefixCache(self, request, context):
        engine = await self._ready(context)
        dropped = sum(p.blocks.pool.reset_cache() for p in engine.pools)
        log.info("prefix_cache_reset", num_blocks_dropped=dropped)
        return scheduler_pb2.ResetPrefixCacheResponse(num_blocks_dropped=dropped)

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


def lora_to_pb(entry: LoraEntry) -> generate_pb2.LoraAdapterInfo:
    return generate_pb2.LoraAdapterInfo(
        lora_name=entry.name, lora_path=entry.path, source=entry.source
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
        kv_transfers=counters.kv_transfers,
        kv_source_lag_ms_total=counters.kv_source_lag_s * 1e3,
        kv_blocks_reused=counters.kv_blocks_reused,
        steps=counters.steps,
        mean_execute_ms=counters.mean_execute_ms,
        mean_step_interval_ms=counters.mean_step_interval_ms,
        mean_step_overhead_ms=counters.mean_step_overhead_ms,
        num_swap_blocks=0 if swap is None else swap.num_blocks,
        num_free_swap_blocks=0 if swap is None else swap.num_free_blocks,
        kv_migrations_out=pool.scheduler.num_migrations_out,
        prompt_tokens_computed=pool.scheduler.num_prompt_tokens_computed,
        spec_decode_num_steps=pool.scheduler.spec_decode.num_steps,
        spec_decode_num_draft_tokens=pool.scheduler.spec_decode.num_draft_tokens,
        spec_decode_num_accepted_tokens=pool.scheduler.spec_decode.num_accepted_tokens,
        **offload_stats(pool.scheduler.offload),
    )


def offload_stats(offload) -> dict[str, int]:
    """The offload tier's PoolStats fields (zeros without one)."""
    if offload is None:
        return {}
    return dict(
        num_offload_cpu_blocks=offload.num_blocks,
        num_offload_cpu_cached_blocks=offload.num_cached_blocks,
        offload_saved_blocks=offload.num_saved_blocks,
        offload_loaded_blocks=offload.num_loaded_blocks,
        offload_hit_tokens=offload.num_hit_tokens,
        num_offload_disk_blocks=offload.num_disk_blocks,
        offload_disk_saved_blocks=offload.num_disk_saved_blocks,
        offload_disk_loaded_blocks=offload.num_disk_loaded_blocks,
        offload_disk_failed_blocks=offload.num_disk_failed_blocks,
    )


def samples_from_pb(
    request: scheduler_pb2.SubmitRequest,
    max_model_len: int,
    retention: RetentionLimits = RetentionLimits(),  # noqa: B008 (frozen)
) -> list[Request]:
    """The n samples of a SubmitRequest as separate requests (sample i: seed + i; only
    sample 0 computes prompt logprobs)."""
    n = request.n or 1
    if not 1 <= n <= MAX_SAMPLES:
        raise InvalidRequestError(f"n must be in 1..{MAX_SAMPLES}, got {n}")
    problem = retention.problem(request.kv_retention_s)
    if problem is not None:
        raise InvalidRequestError(problem)
    structured = constraint_from_pb(request.structured_output)  # each sample its matcher
    samples = [
        Request(
            request_id=request.request_id if n == 1 else f"{request.request_id}/{i}",
            prompt_token_ids=list(request.prompt_token_ids),
            max_tokens=request.max_tokens,
            sampling=sampling_from_pb(request.sampling, i, with_prompt_logprobs=i == 0),
            stop_token_ids=frozenset(request.stop_token_ids),
            cache_salt=request.cache_salt,
            kv_retention_s=request.kv_retention_s,
            lora_name=request.lora_name,
            structured=structured,
            max_model_len=max_model_len,
            index=i,
        )
        for i in range(n)
    ]
    for sample in samples[1:]:
        sample.prompt_of = samples[0].request_id
    return samples


def beam_template_from_pb(
    request: scheduler_pb2.SubmitRequest,
    max_model_len: int,
    retention: RetentionLimits = RetentionLimits(),  # noqa: B008 (frozen)
) -> tuple[Request, BeamParams]:
    """A beam search request: (what each of its requests starts from, greedy with the
    policy's candidates as logprobs; the policy's settings, the stop tokens its EOS ids)."""
    beam = request.beam_search
    problem = retention.problem(request.kv_retention_s)
    if problem is not None:
        raise InvalidRequestError(problem)
    if not 1 <= beam.beam_width <= MAX_BEAM_WIDTH:
        raise InvalidRequestError(
            f"beam_search.beam_width must be in 1..{MAX_BEAM_WIDTH}, got {beam.beam_width}"
        )
    if beam.early_stopping not in EARLY_STOPPING:
        raise InvalidRequestError(f"beam_search.early_stopping: {beam.early_stopping!r}")
    if request.HasField("structured_output"):
        raise InvalidRequestError("structured_output is not supported with beam_search")
    if request.max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be >= 1, got {request.max_tokens}")
    try:
        params = BeamParams(
            beam_width=beam.beam_width,
            length_penalty=beam.length_penalty,
            early_stopping=EARLY_STOPPING[beam.early_stopping],
            eos_token_ids=tuple(sorted(set(request.stop_token_ids))),
            max_new_tokens=request.max_tokens,
            num_return_sequences=request.n or 1,
            prompt_len=max(1, len(request.prompt_token_ids)),
        )
    except ValueError as exc:
        raise InvalidRequestError(f"beam_search: {exc}") from None
    template = Request(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        max_tokens=request.max_tokens,
        cache_salt=request.cache_salt,
        kv_retention_s=request.kv_retention_s,
        lora_name=request.lora_name,
        max_model_len=max_model_len,
    )
    needed = BeamSearch(params).candidates_needed()
    if needed > MAX_INTERNAL_LOGPROBS:
        raise InvalidRequestError(
            f"beam_search needs max(2, 1 + stop tokens) * beam_width = {needed} candidates "
            f"per beam; at most {MAX_INTERNAL_LOGPROBS}"
        )
    template.sampling = SamplingParams(logprobs=needed)  # greedy, plain: raw logprobs
    return template, params
