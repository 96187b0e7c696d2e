"""`python -m services.gateway`: the public API process."""

from __future__ import annotations

import asyncio
import os
import sys

from common.auth import BearerTokenInterceptor
from common.config import parse_size
from common.gguf_checkpoint import resolve_model
from common.grpc_server import ServiceHost
from common.hf_checkpoint_reader import load_tokenizer
from common.lifecycle import freeze_startup_heap, run_service, wait_for_shutdown_signal
from common.log import get_logger, setup_logging
from common.metrics import start_metrics_server
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from common.retention import RetentionLimits
from services.gateway.chat_output import ParserSettings
from services.gateway.config import GatewayConfig
from services.gateway.metrics import rejected
from services.gateway.schedulers import Schedulers
from services.gateway.server import GenerateServicer

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
log = get_logger("services.gateway")


async def serve(config: GatewayConfig) -> None:
    setup_logging("gateway", config.log_level)
    model = await asyncio.to_thread(resolve_model, config.model, config.tokenizer)
    tokenizer = await asyncio.to_thread(load_tokenizer, model)
    api_key = config.resolved_api_key
    interceptors = (
        [BearerTokenInterceptor(api_key, on_denied=lambda _: rejected("UNAUTHENTICATED"))]
        if api_key
        else []
    )
    host = ServiceHost(
        [SERVICE_NAME],
        interceptors=interceptors,
        max_receive_bytes=parse_size(config.max_request_bytes),
    )
    schedulers = Schedulers(config.scheduler, host.tls, config.router_config)
    parsers = ParserSettings(
        tool_call_parser=config.tool_call_parser,
        enable_auto_tool_choice=config.enable_auto_tool_choice,
        reasoning_parser=config.reasoning_parser,
    )
    servicer = GenerateServicer(
        tokenizer,
        schedulers,
        config.default_max_tokens,
        config.allow_runtime_lora_updating,
        RetentionLimits(config.max_kv_retention_s),
        parsers,
        config.resolved_chat_template,
    )
    servicer.served_model_names = config.served_model_name
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, host.server)
    watcher = metrics = None
    try:
        async with host.running(config.host, config.port, log, grace=5.0):
            metrics = start_metrics_server(config.host, config.metrics_port)
            servicer.set_model(await schedulers.wait_models(config.scheduler_ready_timeout_s))
            schedulers.start()
            freeze_startup_heap()
            await host.set_serving(True)
            # The gateway can serve only while a scheduler can: NOT_SERVING also when
            # every scheduler is down or does not answer.
            watcher = asyncio.create_task(
                schedulers.watch_health(host.set_serving, config.scheduler_health_interval_s)
            )
            log.info(
                "serving",
                model=servicer.model.name,
                scheduler=",".join(config.scheduler),
                auth="bearer" if api_key else "off",
                metrics=f"{config.host}:{metrics.port}" if metrics else "off",
            )
            log.info("shutting_down", signal=await wait_for_shutdown_signal())
            # Drain: NOT_SERVING, new requests refused, open streams run to the end.
            watcher.cancel()
            servicer.draining = True
            await host.set_serving(False)
            drained = await servicer.drain(config.drain_timeout_s)
            log.info("drained" if drained else "drain_timed_out", open=servicer.num_open)
    finally:
        if watcher is not None:
            watcher.cancel()
        if metrics is not None:
            metrics.close()
        await schedulers.close()


def keep_torch_out() -> None:
    """The gateway runs no model, only a tokenizer; but `transformers` imports torch (and
    its compiler stack) whenever it is installed, even for a tokenizer: about 4 s of CPU
    and 200 MB at every gateway start, the slowest part of starting a stack. Marked
    absent, torch stays unloaded and transformers takes its torch-free path; the tokenizer
    is the same (the API tests compare it with one loaded beside torch)."""
    sys.modules.setdefault("torch", None)  # a process that has torch already keeps it
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found"


def main() -> None:
    keep_torch_out()
    run_service(
        GatewayConfig,
        serve,
        prog="python -m services.gateway",
        trace_name=lambda _: "tandem-gateway",
    )


if __name__ == "__main__":
    main()
