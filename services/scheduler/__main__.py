"""`python -m services.scheduler`: the scheduler process."""

from __future__ import annotations

import asyncio

from common.grpc_server import ServiceHost
from common.lifecycle import freeze_startup_heap, run_service, wait_for_shutdown_signal
from common.log import get_logger, setup_logging
from common.metrics import REGISTRY, LoopCollector, start_metrics_server
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.scheduler import bootstrap
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_event_hub import KvEventHub
from services.scheduler.metrics import RequestTimes, kv_event_families, pool_families
from services.scheduler.server import SchedulerServicer

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


async def serve(config: SchedulerConfig) -> None:
    setup_logging("scheduler", config.log_level)
    log = get_logger("services.scheduler")
    host = ServiceHost([SERVICE_NAME])
    servicer = SchedulerServicer()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, host.server)
    health_updates: set[asyncio.Task] = set()

    def on_serving_change(serving: bool) -> None:
        if servicer.draining:
            return
        task = asyncio.get_running_loop().create_task(host.set_serving(serving))
        health_updates.add(task)
        task.add_done_callback(health_updates.discard)

    async with host.running(config.host, config.port, log, grace=2.0):
        metrics = start_metrics_server(config.host, config.metrics_port)
        engine, model = await bootstrap.connect(config, on_serving_change)
        servicer.engine, servicer.model = engine, model
        engine.on_finish = RequestTimes(model.name).observe
        hub = None
        if config.enable_kv_cache_events:
            hub = servicer.kv_events = KvEventHub(lambda: engine.pools, model.prompt_rope_key)

        def families():
            yield from pool_families(engine, model.name)
            if hub is not None:
                yield from kv_event_families(hub, model.name)

        collector = LoopCollector(asyncio.get_running_loop(), families)
        REGISTRY.register(collector)
        engine.start()
        publishing = None if hub is None else asyncio.ensure_future(hub.run())
        freeze_startup_heap()
        try:
            await host.set_serving(True)
            log.info(
                "serving",
                model=model.name,
                max_model_len=model.max_model_len,
                workers=list(config.workers),
                metrics=f"{config.host}:{metrics.port}" if metrics else "off",
            )
            log.info("shutting_down", signal=await wait_for_shutdown_signal())
            # Drain: refuse new requests, let the running ones finish.
            servicer.draining = True
            await host.set_serving(False)
            drained = await engine.drain(config.drain_timeout_s)
            log.info("drained" if drained else "drain_timed_out", requests=engine.num_requests)
        finally:
            if publishing is not None:
                publishing.cancel()
            if metrics is not None:
                metrics.close()
            REGISTRY.unregister(collector)
            await engine.close()


def main() -> None:
    run_service(
        SchedulerConfig,
        serve,
        prog="python -m services.scheduler",
        trace_name=lambda _: "tandem-scheduler",
    )


if __name__ == "__main__":
    main()
