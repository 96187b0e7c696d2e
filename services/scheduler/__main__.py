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
    port = host.bind(config.host, config.port)
    await host.start()
    log.info("listening", address=f"{config.host}:{port}", workers=list(config.workers))
    engine, model = await bootstrap.connect(config)
    servicer.engine, servicer.model = engine, model
    engine.start()
    await host.set_serving(True)
    log.info("serving", model=model.name, max_model_len=model.max_model_len)
    signal_name = await wait_for_shutdown_signal()
    log.info("shutting_down", signal=signal_name)
    await host.stop(grace=2.0)
    await engine.close()


def main() -> None:
    run_service(SchedulerConfig, serve, prog="python -m services.scheduler")


if __name__ == "__main__":
    main()
