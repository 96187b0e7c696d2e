"""KV-transfer bandwidth over UCX between two processes vs a plain memcpy of the same bytes.

A sender and a receiver process each own a `KvCache` and a `UcxTransport` (what workers
use). Each round the sender gathers N scattered blocks into one reused staging buffer and sends it
as one tagged message; the receiver receives into its own reused buffer and scatters it into
N other blocks (exactly what workers do). Reported: GB/s of the whole
path (gather + UCX + scatter, as the receiver sees it), of the UCX message alone, and of a
`torch` copy of the same bytes in one process. JSON goes to bench/results/.

    python -m bench.kv_transfer [--blocks 32] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
# A Llama-3-8B-shaped block: 32 layers, 8 KV heads of 128, 16 tokens, bf16 -> 2 MiB.
GEOMETRY = dict(block_size=16, num_layers=32, num_kv_heads=8, head_dim=128)


def make_cache(num_blocks: int, dtype: torch.dtype):
    from services.worker.kv_cache import KvCache

    return KvCache(num_blocks=num_blocks, dtype=dtype, **GEOMETRY)


def receiver(conn, num_blocks: int, dtype_name: str, rounds: int, per_round: int) -> None:
    from services.worker.kv_transfer import UcxTransport
    from services.worker.staging import StagingBuffers

    async def run() -> None:
        cache = make_cache(num_blocks, getattr(torch, dtype_name))
        transport = UcxTransport(error_handling=False)  # the shared-memory path measured
        conn.send_bytes(transport.address)  # raw bytes and JSON: never pickle
        dst = list(range(num_blocks - per_round, num_blocks))
        staging = StagingBuffers()
        timings = []
        for r in range(rounds):
            conn.send_bytes(b"ready")
            buffer = staging.acquire(per_round * cache.block_bytes)
            start = time.perf_counter()
            await transport.receive(tag=r + 1, nbytes=buffer.nbytes, out=buffer)
            received = time.perf_counter()
            payload = torch.from_numpy(buffer).view(per_round, cache.block_bytes)
            cache.scatter_blocks(dst, payload)
            timings.append((received - start, time.perf_counter() - start))
            staging.release(buffer)
        checksum = float(cache.data[dst].float().sum())
        conn.send_bytes(json.dumps([timings, checksum]).encode())
        await transport.close()

    asyncio.run(run())


async def sender(conn, num_blocks: int, dtype: torch.dtype, rounds: int, per_round: int):
    from services.worker.kv_transfer import UcxTransport
    from services.worker.staging import StagingBuffers

    cache = make_cache(num_blocks, dtype)
    cache.data.copy_(torch.randn(cache.data.shape, dtype=torch.float32).to(dtype))
    transport = UcxTransport(error_handling=False)
    address = conn.recv_bytes()
    src = list(range(0, 2 * per_round, 2))  # scattered source blocks
    staging = StagingBuffers()
    sends = []
    for r in range(rounds):
        assert conn.recv_bytes() == b"ready"
        buffer = staging.acquire(per_round * cache.block_bytes)
        start = time.perf_counter()
        cache.gather_blocks(src, out=torch.from_numpy(buffer).view(per_round, -1))
        gathered = time.perf_counter()
        await transport.send("bench-peer", address, tag=r + 1, payload=buffer)
        sends.append((gathered - start, time.perf_counter() - gathered))
        staging.release(buffer)
    timings, checksum = json.loads(conn.recv_bytes())
    expected = float(cache.data[src].float().sum())
    await transport.close()
    return sends, timings, checksum == expected


def memcpy_gbps(nbytes: int, rounds: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=32, help="blocks per transfer")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    num_blocks = 2 * args.blocks + 1
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=receiver, args=(child, num_blocks, args.dtype, args.rounds + 1, args.blocks)
    )
    proc.start()
    sends, timings, intact = asyncio.run(
        sender(parent, num_blocks, dtype, args.rounds + 1, args.blocks)
    )
    proc.join(timeout=60)
    block_bytes = make_cache(1, dtype).block_bytes
    nbytes = args.blocks * block_bytes
    # Round 0 includes endpoint creation: reported apart.
    ucx = statistics.median(t[0] for t in timings[1:])
    whole = statistics.median(t[1] for t in timings[1:])
    report = {
        "benchmark": "kv_transfer",
        "geometry": {**GEOMETRY, "dtype": args.dtype, "block_bytes": block_bytes},
        "blocks_per_transfer": args.blocks,
        "bytes_per_transfer": nbytes,
        "rounds": args.rounds,
        "bit_identical": intact,
        "first_transfer_ms_incl_connect": round(timings[0][1] * 1e3, 2),
        "receive_path_gbps": round(nbytes / whole / 1e9, 2),
        "ucx_message_gbps": round(nbytes / ucx / 1e9, 2),
        "sender_gather_gbps": round(nbytes / statistics.median(s[0] for s in sends[1:]) / 1e9, 2),
        "sender_send_gbps": round(nbytes / statistics.median(s[1] for s in sends[1:]) / 1e9, 2),
        "memcpy_gbps_same_bytes": round(memcpy_gbps(nbytes, args.rounds), 2),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
    }
    report["ucx_over_memcpy"] = round(
        report["ucx_message_gbps"] / report["memcpy_gbps_same_bytes"], 2
    )
    print(json.dumps(report, indent=2))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "kv_transfer_cpu.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
