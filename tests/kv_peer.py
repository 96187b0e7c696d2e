"""Receiving side of the KV-transfer test, run as its own process.

Loads a real decode Worker, prints its UCX address, then for each JSON command on stdin
(`{"tag": int, "blocks": [...], "out": path}`) receives one transfer into those blocks and
writes the raw bytes of the blocks to `out`. Prints one JSON line per finished command.
"""

import asyncio
import json
import sys

from common.log import setup_logging
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
        result = await worker.peer_kv.receive(command["tag"], command["blocks"])
        data = worker.kv_cache.gather_blocks(command["blocks"]).numpy().tobytes()
        with open(command["out"], "wb") as f:
            f.write(data)
        print(json.dumps({"num_bytes": result.num_bytes}), flush=True)
    await worker.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3] == "1"))
