"""Process entry helpers: config errors end the process with a clear message (exit 2),
SIGTERM/SIGINT end `serve` gracefully, tracing (`common/tracing.py`) starts with the
process and flushes what it buffered when the process ends, and `freeze_startup_heap`
takes what start-up built out of the garbage collector's way."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from common.config import load_config
from common.tracing import setup_tracing, shutdown_tracing

C = TypeVar("C")


class StartupError(RuntimeError):
    """The service cannot start (a peer never became ready, ...): exit 2 with the message."""


def freeze_startup_heap() -> None:
    """Once a service has loaded (imports, model, tokenizer) and before it serves: collect
    the start-up garbage, then move every object left to the collector's permanent
    generation (`gc.freeze`). A worker holds ~200k objects from torch alone; each full
    collection walked them all (~0.1 s, a pause in the middle of serving whenever one
    ran), and the collection at interpreter exit took 0.5-1 s per process."""
    gc.collect()
    gc.freeze()


async def wait_until(done: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll `done` until it is true (True) or timeout_s passed (False): drains use it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not done():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(interval_s)
    return True


async def wait_for_shutdown_signal() -> str:
    """Return the name of the first SIGTERM/SIGINT received, or "parent-exited" when
    TANDEM_EXIT_WITH_PARENT=1 and the process that started this one is gone (test stacks
    must not outlive a killed test run)."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[str] = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: received.done() or received.set_result(s.name))
    watcher = None
    if os.environ.get("TANDEM_EXIT_WITH_PARENT") == "1":
        watcher = loop.create_task(_watch_parent(received, os.getppid()))
    try:
        return await received
    finally:
        if watcher is not None:
            watcher.cancel()


async def _watch_parent(done: asyncio.Future[str], parent: int) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    if not done.done():
        done.set_result("parent-exited")


def run_service(
    config_cls: type[C],
    serve: Callable[[C], Coroutine[Any, Any, None]],
    prog: str,
    trace_name: Callable[[C], str] | None = None,
) -> None:
    """Parse the service's config (flags and TANDEM_* env) and run `serve` until a signal.
    `trace_name`: the process's OpenTelemetry `service.name` (traced only when the OTEL_*
    environment names an endpoint); spans still buffered are exported on the way out."""
    faulthandler.enable()  # a native crash (UCX, torch) leaves its stack in the log
    try:
        config = load_config(config_cls, prog=prog)
        if trace_name is not None:
            setup_tracing(trace_name(config))
    except ValueError as exc:
        print(f"{prog}: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass
    except (ValueError, StartupError) as exc:  # e.g. a KV pool too small, a peer never up
        print(f"{prog}: startup error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        shutdown_tracing()
