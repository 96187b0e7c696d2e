"""`python -m services.scheduler`: the scheduler process."""

from __future__ import annotations

from common.grpc_server import ServiceHost
from common.lifecycle import run_service, wait_for_shutdown_signal
from common.log import get_logger, setup_logging
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.scheduler import bootstrap
from services.scheduler.config import SchedulerConfig
from services.scheduler.server import SchedulerServicer

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


async def serve(config: SchedulerConfig) -> None:
    setup_logging("scheduler", config.log_level)
    log = get_logger("services.scheduler")
    host = ServiceHost([SERVICE_NAME])
    servicer = SchedulerServicer()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, host.server)
    async with host.running(config.host, config.port, log, grace=2.0):
        engine, model = await bootstrap.connect(config)
        servicer.engine, servicer.model = engine, model
        engine.start()
        try:
            await host.set_serving(True)
            log.info(
                "serving",
                model=model.name,
                max_model_len=model.max_model_len,
                workers=list(config.workers),
            )
            log.info("shutting_down", signal=await wait_for_shutdown_signal())
        finally:
            await engine.close()


def main() -> None:
    run_service(SchedulerConfig, serve, prog="python -m services.scheduler")


if __name__ == "__main__":
    main()
