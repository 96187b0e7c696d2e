"""Receiving side of the KV-transfer test, run as its own process.

Loads a real decode Worker, prints its UCX address, then for each JSON command on stdin
(`{"tag": int, "blocks": [...], "out": path, "sender_tp": int}`) receives one transfer into
those blocks as a step plan's KV load does (`PeerKvConnector.start_loads`, its outcome as
the step result reports it) and writes the raw bytes of the blocks to `out`. Prints one
JSON line per finished command (the outcome's error, if any).
"""

import asyncio
import json
import sys

from common.log import setup_logging
from common.parallel_plan import Layout
from common.step_plan import KvLoad
from services.worker.config import WorkerConfig
from services.worker.worker import Worker


async def main(model: str, dtype: str, error_handling: bool) -> None:
    setup_logging("kv-peer", "warning")  # logs to stderr; stdout carries the protocol
    config = WorkerConfig(
        model=model,
        role="decode",
        dtype=dtype,
        num_blocks=64,
        port=0,
        kv_transfer_error_handling=error_handling,
    )
    worker = await Worker.load(config, "kv-peer")
    print(
        json.dumps(
            {
                "address": worker.peer_kv.transport.address.hex(),
                "block_bytes": worker.kv_cache.block_bytes,
            }
        ),
        flush=True,
    )
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command = json.loads(line)
        layout = Layout(command.get("sender_tp", 1))
        worker.peer_kv.start_loads([KvLoad(command["tag"], command["blocks"], None, layout)], 1)
        await worker.peer_kv.load_ended.wait()
        ((_, _, result),) = worker.peer_kv.take_done()
        if result.error:
            print(json.dumps({"error": result.error}), flush=True)
            continue
        data = worker.kv_cache.gather_blocks(command["blocks"]).numpy().tobytes()
        with open(command["out"], "wb") as f:
            f.write(data)
        print(json.dumps({"num_bytes": result.num_bytes}), flush=True)
    await worker.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3] == "1"))
