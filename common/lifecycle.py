"""Process entry helpers: config errors end the process with a clear message (exit 2), and
SIGTERM/SIGINT end `serve` gracefully."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from common.config import load_config

C = TypeVar("C")


async def wait_for_shutdown_signal() -> str:
    """Return the name of the first SIGTERM/SIGINT received."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[str] = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: received.done() or received.set_result(s.name))
    return await received


def run_service(
    config_cls: type[C], serve: Callable[[C], Coroutine[Any, Any, None]], prog: str
) -> None:
    """Parse the service's config (flags and TANDEM_* env) and run `serve` until a signal."""
    try:
        config = load_config(config_cls, prog=prog)
    except ValueError as exc:
        print(f"{prog}: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass
    except ValueError as exc:  # a setting that only shows at startup (e.g. the KV pool size)
        print(f"{prog}: startup error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
