"""WorkerService servicer: translates protobuf to the Worker's domain calls and back (and
continues a traced request's trace: its span per step stream, `request_spans.py`, a span
per SendKv, and one per KV load of a plan, `kv_peer_connector`)."""

from __future__ import annotations

import asyncio
import time

import grpc

from common.config import KV_TRANSFER_TIMEOUT_METADATA, PROFILE_NUM_TOKENS_METADATA
from common.kv_shared_memory import shared_memory_to_pb
from common.lifecycle import wait_until
from common.log import get_logger
from common.parallel_plan import Layout
from common.pb.tandem.internal.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from common.rope_config import rope_length_threshold
from common.sampling_pb import ROLE_TO_PB
from common.step_plan_pb import plan_from_pb
from common.step_result_pb import kv_load_done_pb, result_to_pb
from common.structured_output import ConstraintError, constraint_from_pb
from common.tracing import rpc_span
from services.worker.batch import PlanError
from services.worker.kv_transfer import KvTransferCancelled, KvTransferError
from services.worker.metrics import WorkerMetrics
from services.worker.request_spans import RequestSpans
from services.worker.worker import KV_LAYOUT, LoraDisabledError, Worker

log = get_logger(__name__)
SLOW_STEP_S = 2.0  # a step this slow is logged with what it ran


def _kv_attributes(request) -> dict:
    """A SendKv span's attributes (the tag in hex: it is a uint64)."""
    return {
        "tandem.kv.transfer_tag": f"{request.transfer_tag:016x}",
        "tandem.kv.blocks": len(request.block_ids),
    }


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, boot_id: str = "") -> None:
        """`boot_id`: its host's (`ServiceHost.boot_id`), the same in health answers."""
        self.boot_id = boot_id
        self.worker: Worker | None = None
        self._metrics: WorkerMetrics | None = None
        self._step_stream_id = 0
        self._open_streams = 0
        # Set on SIGTERM: every step result says so from then on (StepResponse.draining).
        self.draining = False

    @property
    def metrics(self) -> WorkerMetrics:
        """This worker's metrics (labelled once the worker has loaded)."""
        if self._metrics is None:
            w = self.worker
            self._metrics = WorkerMetrics(
                w.model_config.name, w.worker_id, w.role, w.peer_kv.transport.held_bytes
            )
        return self._metrics

    async def drain(self, timeout_s: float, settle_s: float = 1.0) -> bool:
        """Wait until no scheduler drives this worker, or it has held no request and no
        transfer for settle_s (the scheduler has seen NOT_SERVING by then); False if
        timeout_s ran out first."""
        loop, idle_since = asyncio.get_running_loop(), None

        def drained() -> bool:
            nonlocal idle_since
            if not self._open_streams:
                return True
            if not self.worker.is_idle:
                idle_since = None
                return False
            idle_since = idle_since or loop.time()
            return loop.time() - idle_since >= settle_s

        return await wait_until(drained, timeout_s)

    async def _ready(self, context: grpc.aio.ServicerContext) -> Worker:
        if self.worker is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is still loading")
        return self.worker

    async def DescribeWorker(self, request, context):
        worker = await self._ready(context)
        cfg = worker.model_config
        # Settings the scheduler checks against its own when it connects, as metadata (the
        # proto stays as it is). Only a CUDA worker profiles a step's activation memory.
        limits = [(KV_TRANSFER_TIMEOUT_METADATA, repr(worker.config.kv_transfer_timeout_s))]
        if worker.device.type == "cuda":
            limits.append((PROFILE_NUM_TOKENS_METADATA, str(worker.config.profile_num_tokens)))
        await context.send_initial_metadata(limits)
        return worker_pb2.DescribeWorkerResponse(
            worker_id=worker.worker_id,
            boot_id=self.boot_id,
            role=ROLE_TO_PB[worker.role],
            model=types_pb2.ModelDescription(
                name=cfg.name,
                architecture=cfg.architecture,
                vocab_size=cfg.vocab_size,
                max_model_len=worker.max_model_len,
                eos_token_ids=list(cfg.eos_token_ids),
                dtype=str(worker.kv_cache.dtype).removeprefix("torch."),
                num_layers=cfg.num_hidden_layers,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim,
                lora_adapters=[] if worker.lora is None else worker.lora.names,
                rope_type=cfg.rope_type,
                rope_length_threshold=rope_length_threshold(cfg),
                kv_group_windows=[w or 0 for w in worker.kv_groups.windows],
            ),
            kv_cache=types_pb2.KvCacheDescription(
                num_blocks=worker.kv_cache.num_blocks,
                block_size=worker.kv_cache.block_size,
                block_bytes=worker.model_block_bytes,
                layout=KV_LAYOUT,
                num_swap_blocks=0 if worker.swap_cache is None else worker.swap_cache.num_blocks,
                num_offload_cpu_blocks=(
                    0 if worker.offload_cache is None else worker.offload_cache.num_blocks
                ),
                num_offload_disk_blocks=(
                    0 if worker.disk_offload is None else worker.disk_offload.capacity_blocks
                ),
                offload_disk_hashes=(
                    [] if worker.disk_offload is None else worker.disk_offload.hashes()
                ),
            ),
            ucx_address=worker.peer_kv.transport.address,
            num_active_requests=len(worker.batch),
            device=str(worker.device),
            kv_shared_memory=(
                None if worker.shared_pool is None else shared_memory_to_pb(worker.shared_pool.info)
            ),
            tensor_parallel_size=worker.layout.tp,
            pipeline_parallel_size=worker.layout.pp,
            rank_kv_shared_memory=[
                shared_memory_to_pb(m) for m in worker.rank_shared_memory if m is not None
            ],
            rank_ucx_addresses=list(worker.rank_ucx_addresses),
            max_loras=0 if worker.lora is None else worker.lora.max_loras,
            speculative=(
                None
                if worker.speculative is None
                else worker_pb2.SpeculativeDecoding(
                    method=worker.speculative.method,
                    num_speculative_tokens=worker.speculative.num_speculative_tokens,
                    disable_by_batch_size=worker.speculative.disable_by_batch_size or 0,
                )
            ),
        )

    async def Step(self, request_iterator, context):
        worker = await self._ready(context)
        self._step_stream_id += 1
        stream_id = self._step_stream_id
        worker.reset()  # a new stream means a new (or restarted) scheduler
        log.info("step_stream_opened", stream=stream_id)
        self._open_streams += 1
        spans = RequestSpans(worker.worker_id, worker.role)
        try:
            async for response in self._steps(worker, stream_id, spans, request_iterator, context):
                yield response
        finally:
            spans.close_all("the step stream ended")
            self._open_streams -= 1
            if stream_id == self._step_stream_id:  # the scheduler went away: free it all
                worker.reset()
            log.info("step_stream_closed", stream=stream_id)

    async def _steps(
        self, worker: Worker, stream_id: int, spans: RequestSpans, request_iterator, context
    ):
        """Plans are queued on the tensor thread as soon as they arrive (a step follows the
        previous one without waiting for this loop); results go back in order."""
        submitted: asyncio.Queue = asyncio.Queue()
        arrived = asyncio.Event()  # set as each plan is queued
        reader = asyncio.ensure_future(
            self._submit_plans(worker, stream_id, spans, request_iterator, submitted, arrived)
        )
        try:
            while (item := await submitted.get()) is not None:
                if isinstance(item, str):
                    await context.abort(grpc.StatusCode.ABORTED, item)
                step_id, new, future, await_kv = item
                try:
                    output = await future
                except PlanError as exc:
                    log.error("bad_step_plan", step_id=step_id, error=str(exc))
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                await worker.mark_executed(step_id)
                if await_kv:
                    await self._await_kv(worker, submitted, arrived)
                self.metrics.step(output.execute_seconds)
                if output.execute_seconds > SLOW_STEP_S:
                    log.warning(
                        "slow_step",
                        step_id=step_id,
                        seconds=round(output.execute_seconds, 3),
                        requests=len(worker.batch),
                        new=[(r.request_id, len(r.token_ids), str(r.sampling)) for r in new][:8],
                    )
                response = result_to_pb(output)
                response.draining = self.draining
                if worker.peer_kv.load_ended.is_set():  # (some load ended since)
                    response.kv_loads_done.extend(self._loads_done(worker))
                yield response
        finally:
            reader.cancel()

    @staticmethod
    async def _await_kv(worker: Worker, submitted: asyncio.Queue, arrived: asyncio.Event):
        """An `await_kv` plan: return once a KV load ended or the next plan arrived (or no
        load is left to end)."""
        peer = worker.peer_kv
        while submitted.empty() and not peer.load_ended.is_set() and peer.receiving:
            arrived.clear()
            waits = [asyncio.ensure_future(e.wait()) for e in (arrived, peer.load_ended)]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()

    def _loads_done(self, worker: Worker) -> list:
        """The KV loads that ended since the last result (counted in the metrics)."""
        done = []
        for direction, how, outcome in worker.peer_kv.take_done():
            if how == "ok":
                self.metrics.transfer(direction, outcome.num_bytes, outcome.seconds)
            elif how == "cancelled":
                self.metrics.transfer_cancelled(direction)
            else:
                self.metrics.transfer_failed(direction)
            done.append(kv_load_done_pb(outcome))
        return done

    async def _submit_plans(
        self,
        worker: Worker,
        stream_id: int,
        spans: RequestSpans,
        request_iterator,
        submitted: asyncio.Queue,
        arrived: asyncio.Event,
    ) -> None:
        try:
            async for plan in request_iterator:
                if stream_id != self._step_stream_id:
                    submitted.put_nowait("a newer Step stream took over")
                    return
                step = plan_from_pb(plan)
                spans.plan(step)
                worker.peer_kv.cancel(step.cancelled_transfer_tags)
                future = worker.submit_step(
                    step.finished_ids, step.new, step.cached, step.moves, step.step_id, wire=plan
                )
                worker.peer_kv.start_loads(step.kv_loads, step.step_id)  # (after the step)
                item = (step.step_id, step.new, asyncio.wrap_future(future), step.await_kv)
                submitted.put_nowait(item)
                arrived.set()
        finally:
            submitted.put_nowait(None)
            arrived.set()

    async def SendKv(self, request, context):
        worker = await self._ready(context)
        with rpc_span("kv_send", context, _kv_attributes(request)):
            return await self._send_kv(worker, request, context)

    async def _send_kv(self, worker: Worker, request, context):
        try:
            peer_layout = Layout(
                max(1, request.peer_tensor_parallel_size),
                max(1, request.peer_pipeline_parallel_size),
            )
            started = time.perf_counter()
            num_bytes = await worker.peer_kv.send(
                request.transfer_tag,
                request.peer_worker_id,
                request.peer_ucx_address,
                list(request.block_ids),
                peer_layout,
                list(request.peer_rank_ucx_addresses),
            )
        except ValueError as exc:  # a layout this model cannot have
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peer layout: {exc}")
        except KvTransferCancelled as exc:
            self.metrics.transfer_cancelled("send")
            await context.abort(grpc.StatusCode.CANCELLED, str(exc))
        except KvTransferError as exc:
            self.metrics.transfer_failed("send")
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        seconds = time.perf_counter() - started
        self.metrics.transfer("send", num_bytes, seconds)
        return worker_pb2.SendKvResponse(num_bytes=num_bytes, seconds=seconds)

    async def AddLora(self, request, context):
        worker = await self._ready(context)
        if not request.lora_name or not request.lora_path:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "lora_name and lora_path are required"
            )
        try:
            names = await worker.add_lora(request.lora_name, request.lora_path)
        except LoraDisabledError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (ValueError, OSError) as exc:  # LoraAdapterError says what is wrong
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info("lora_added", lora_name=request.lora_name, lora_path=request.lora_path)
        return worker_pb2.AddLoraResponse(lora_adapters=names)

    async def RemoveLora(self, request, context):
        worker = await self._ready(context)
        try:
            names = await worker.remove_lora(request.lora_name)
        except LoraDisabledError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        log.info("lora_removed", lora_name=request.lora_name)
        return worker_pb2.RemoveLoraResponse(lora_adapters=names)

    async def PrepareStructuredOutput(self, request, context):
        worker = await self._ready(context)
        try:
            constraint = constraint_from_pb(request.structured_output)
            if constraint is None:
                raise ConstraintError("structured_output must set one constraint")
            seconds = await worker.prepare_structured(constraint)
        except ConstraintError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"structured_output: {exc}")
        return worker_pb2.PrepareStructuredOutputResponse(seconds=seconds)
