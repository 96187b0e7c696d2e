"""`python -m services.worker`: a prefill, decode or both-role worker process."""

from __future__ import annotations

import asyncio
import dataclasses

from common.gguf_checkpoint import resolve_model
from common.grpc_server import ServiceHost
from common.lifecycle import freeze_startup_heap, run_service, wait_for_shutdown_signal
from common.log import get_logger, setup_logging
from common.metrics import start_metrics_server
from common.pb.tandem.internal.v1 import worker_pb2, worker_pb2_grpc
from services.worker.config import WorkerConfig
from services.worker.server import WorkerServicer
from services.worker.worker import Worker

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name


async def serve(config: WorkerConfig) -> None:
    setup_logging("worker", config.log_level)
    log = get_logger("services.worker")
    # A GGUF file is read through its converted folder (built on first use).
    model = await asyncio.to_thread(resolve_model, config.model, config.tokenizer)
    config = dataclasses.replace(config, model=model, tokenizer="")
    host = ServiceHost([SERVICE_NAME])
    servicer = WorkerServicer(host.boot_id)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, host.server)
    async with host.running(config.host, config.port, log, grace=2.0) as port:
        worker_id = config.worker_id or f"{config.role}-{port}"
        metrics = start_metrics_server(config.host, config.metrics_port)
        servicer.worker = await Worker.load(config, worker_id)
        freeze_startup_heap()
        try:
            await host.set_serving(True)
            log.info(
                "serving",
                worker_id=worker_id,
                metrics=f"{config.host}:{metrics.port}" if metrics else "off",
            )
            log.info("shutting_down", signal=await wait_for_shutdown_signal())
            # Drain: NOT_SERVING (and `draining` on every step result) tells the scheduler
            # to place nothing new here; the requests this worker holds run to the end.
            servicer.draining = True
            await host.set_serving(False)
            drained = await servicer.drain(config.drain_timeout_s)
            log.info("drained" if drained else "drain_timed_out")
        finally:
            if metrics is not None:
                metrics.close()
            await servicer.worker.close()


def main() -> None:
    run_service(
        WorkerConfig,
        serve,
        prog="python -m services.worker",
        trace_name=lambda config: f"tandem-worker-{config.role}",
    )


if __name__ == "__main__":
    main()
