"""KV-transfer bandwidth and latency between two processes, by path, vs a memcpy of the
same bytes.

Paths measured, each from "the source blocks are final" to "the blocks are in place in
the receiver's pool" (what a decode step waits for), for 1, 16 and 32 blocks of a
Llama-3-8B-shaped bf16 pool (2 MiB per block: 2, 32 and 64 MiB):

- `shared_memory_pull` (the default between same-host CPU workers): the receiver copies
  the blocks straight out of the owner's shared pool (`kv_pull`: one copy per run of
  consecutive blocks, on the receiver's tensor thread, no staging, no message);
- `ucx_tcp` (UCX with peer-failure handling, the default across hosts): the sender
  gathers into a staging buffer and sends one tagged message; the receiver receives into
  its own staging buffer and scatters it into its blocks;
- `ucx_shm` (UCX without peer-failure handling: shared memory, the unsafe fast path of
  before): the same, over shared memory.

Source blocks are scattered (every other block) and land on consecutive blocks, as a
hand-off's do. Every path's result is checked bit for bit. The memcpy reference is a
`copy_` of the same bytes between two private buffers on the receiver's tensor thread,
timed between the pull's rounds (the box's memory bandwidth drifts by 2x between runs). JSON goes to
bench/results/kv_transfer_cpu.json.

    python -m bench.kv_transfer [--blocks 1 16 32] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.report import write_report

RESULTS = Path(__file__).resolve().parent / "results"
# A Llama-3-8B-shaped block: 32 layers, 8 KV heads of 128, 16 tokens, bf16 -> 2 MiB.
GEOMETRY = dict(block_size=16, num_layers=32, num_kv_heads=8, head_dim=128)
DTYPE = torch.bfloat16


def make_cache(num_blocks: int, storage=None):
    from services.worker.kv_cache import KvCache

    return KvCache(num_blocks=num_blocks, dtype=DTYPE, storage=storage, **GEOMETRY)


def source_blocks(count: int) -> list[int]:
    return list(range(0, 2 * count, 2))


def dest_blocks(count: int) -> list[int]:
    return list(range(1, count + 1))


def block_digest(cache, blocks: list[int]) -> str:
    """The blocks' bytes, hashed in order: comparable across processes. (A float sum is
    not: the random bit patterns of `fill` include NaNs, and NaN never equals NaN.)"""
    data = cache.data[blocks].contiguous().view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def fill(cache) -> None:
    generator = torch.Generator().manual_seed(0)
    cache.data.view(torch.int16).copy_(
        torch.randint(-30000, 30000, cache.data.shape, dtype=torch.int16, generator=generator)
    )


# -- shared-memory pull ------------------------------------------------------------------
def pool_owner(conn, num_blocks: int) -> None:
    """A worker whose pool lives in shared memory, its blocks final."""
    from services.worker.kv_cache import KvCache
    from services.worker.kv_shared import SharedPool

    pool = SharedPool(
        num_blocks * KvCache.bytes_per_block(dtype=DTYPE, **GEOMETRY), GEOMETRY["num_layers"]
    )
    fill(make_cache(num_blocks, pool.pool))
    conn.send_bytes(pool.info.to_json())  # raw bytes and JSON: never pickle
    conn.recv_bytes()  # until the bench is done


def same_blocks(cache, dst: list[int], reference, src: list[int]) -> bool:
    return torch.equal(cache.data[dst].view(torch.int16), reference.data[src].view(torch.int16))


def measure_pull(sizes: list[int], rounds: int) -> dict[int, dict]:
    from common.kv_shared_memory import SharedMemoryInfo
    from services.worker.kv_pull import KvPuller, KvSource

    num_blocks = 2 * max(sizes) + 1
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=pool_owner, args=(child, num_blocks), daemon=True)
    owner.start()
    info = SharedMemoryInfo.from_json(parent.recv_bytes())
    # The receiving worker's tensor thread: every torch op runs there, as in a worker (a
    # second thread running parallel torch ops makes a second OpenMP team, and both slow).
    executor = ThreadPoolExecutor(max_workers=1)
    cache = executor.submit(make_cache, num_blocks).result()
    reference = executor.submit(make_cache, num_blocks).result()
    executor.submit(fill, reference).result()

    async def on_thread(fn, *args):
        return await asyncio.wrap_future(executor.submit(fn, *args))

    puller = KvPuller(cache, on_thread, lambda tag: False, timeout_s=30.0)

    async def no_wait():
        return None

    async def run() -> dict[int, dict]:
        puller.peer("owner", info)  # mapped once per peer, as a worker does
        out = {}
        for count in sizes:
            src, dst = source_blocks(count), dest_blocks(count)
            memcpy = await on_thread(CopyTimer, count * cache.block_bytes)
            times, copies = [], []
            for r in range(rounds + 1):  # memcpy rounds interleaved: the same conditions
                start = time.perf_counter()
                await puller.pull(r, KvSource("owner", (info,), tuple(src)), dst, no_wait)
                times.append(time.perf_counter() - start)
                copies.append(await on_thread(memcpy.time))
            intact = await on_thread(same_blocks, cache, dst, reference, src)
            out[count] = {
                "seconds": times[1:],
                "memcpy_seconds": copies[1:],
                "bit_identical": intact,
            }
        return out

    try:
        return asyncio.run(run())
    finally:
        puller.close()
        executor.shutdown()
        parent.send_bytes(b"done")
        owner.join(10)


# -- UCX (staging buffers, gather / scatter) ------------------------------------------------
def ucx_receiver(conn, num_blocks: int, sizes: list[int], rounds: int, error_handling: bool):
    from services.worker.kv_transfer import UcxTransport
    from services.worker.parallel.kv_message_io import StagingBuffers

    async def run() -> None:
        cache = make_cache(num_blocks)
        transport = UcxTransport(error_handling=error_handling)
        conn.send_bytes(transport.address)  # raw bytes and JSON: never pickle
        staging = StagingBuffers()
        results = {}
        tag = 0
        for count in sizes:
            dst = dest_blocks(count)
            timings = []
            for _ in range(rounds + 1):
                tag += 1
                conn.send_bytes(b"ready")
                buffer = staging.acquire(count * cache.block_bytes)
                start = time.perf_counter()
                await transport.receive(tag=tag, nbytes=buffer.nbytes, out=buffer)
                payload = torch.from_numpy(buffer).view(count, cache.block_bytes)
                cache.scatter_blocks(dst, payload)
                timings.append(time.perf_counter() - start)
                staging.release(buffer)
            results[count] = {
                "seconds": timings[1:],
                "checksum": block_digest(cache, dst),
            }
        conn.send_bytes(json.dumps(results).encode())
        await transport.close()

    asyncio.run(run())


def ucx_sender(conn, sizes: list[int], rounds: int, error_handling: bool) -> None:
    """Runs in its own process (one UCX context per process), spawning the receiver."""
    from services.worker.kv_transfer import UcxTransport
    from services.worker.parallel.kv_message_io import StagingBuffers

    num_blocks = 2 * max(sizes) + 1
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    receiver = ctx.Process(
        target=ucx_receiver, args=(child, num_blocks, sizes, rounds, error_handling)
    )
    receiver.start()

    async def run() -> dict:
        cache = make_cache(num_blocks)
        fill(cache)
        transport = UcxTransport(error_handling=error_handling)
        address = parent.recv_bytes()
        staging = StagingBuffers()
        tag = 0
        for count in sizes:
            src = source_blocks(count)
            for _ in range(rounds + 1):
                tag += 1
                assert parent.recv_bytes() == b"ready"
                buffer = staging.acquire(count * cache.block_bytes)
                cache.gather_blocks(src, out=torch.from_numpy(buffer).view(count, -1))
                await transport.send("bench-peer", address, tag=tag, payload=buffer)
                staging.release(buffer)
        results = json.loads(parent.recv_bytes())
        for count in sizes:
            expected = block_digest(cache, source_blocks(count))
            entry = results[str(count)]
            entry["bit_identical"] = entry.pop("checksum") == expected
        await transport.close()
        return results

    results = asyncio.run(run())
    receiver.join(60)
    conn.send_bytes(json.dumps(results).encode())


def measure_ucx(sizes: list[int], rounds: int, error_handling: bool) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=ucx_sender, args=(child, sizes, rounds, error_handling))
    process.start()
    results = json.loads(parent.recv_bytes())
    process.join(60)
    return {int(k): v for k, v in results.items()}


class CopyTimer:
    """A memcpy of the same bytes between two private buffers (torch `copy_`, the same
    threads as the pull), timed once per call."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.empty(nbytes, dtype=torch.uint8).random_()
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)

    def time(self) -> float:
        start = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS / "kv_transfer_cpu.json"))
    args = parser.parse_args()
    sizes = sorted(set(args.blocks))
    from services.worker.kv_cache import KvCache

    # No torch op on this thread before the pull: it would start a second OpenMP team.
    block_bytes = KvCache.bytes_per_block(dtype=DTYPE, **GEOMETRY)
    paths = {
        "shared_memory_pull": measure_pull(sizes, args.rounds),
        "ucx_tcp": measure_ucx(sizes, args.rounds, error_handling=True),
        "ucx_shm": measure_ucx(sizes, args.rounds, error_handling=False),
    }
    rows = []
    for count in sizes:
        nbytes = count * block_bytes
        memcpy = statistics.median(paths["shared_memory_pull"][count]["memcpy_seconds"])
        row = {
            "blocks": count,
            "bytes": nbytes,
            "memcpy_us": round(memcpy * 1e6, 1),
            "memcpy_gbps": round(nbytes / memcpy / 1e9, 2),
        }
        for name, results in paths.items():
            seconds = statistics.median(results[count]["seconds"])
            row[f"{name}_us"] = round(seconds * 1e6, 1)
            row[f"{name}_gbps"] = round(nbytes / seconds / 1e9, 2)
            row[f"{name}_of_memcpy"] = round(memcpy / seconds, 3)
            row[f"{name}_bit_identical"] = results[count]["bit_identical"]
        rows.append(row)
    report = {
        "benchmark": "kv_transfer",
        "what": "source blocks final -> blocks in place in the receiver's pool, median",
        "geometry": {
            **GEOMETRY,
            "dtype": str(DTYPE).removeprefix("torch."),
            "block_bytes": block_bytes,
        },
        "rounds": args.rounds,
        "rows": rows,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
    }
    header = f"{'blocks':>6} {'MiB':>5} {'memcpy':>14}" + "".join(f" {name:>24}" for name in paths)
    print(header)
    for row in rows:
        line = (
            f"{row['blocks']:>6} {row['bytes'] >> 20:>5} "
            f"{row['memcpy_us']:>8.0f}us {row['memcpy_gbps']:>4.1f}"
        )
        for name in paths:
            line += (
                f" {row[f'{name}_us']:>8.0f}us {row[f'{name}_gbps']:>5.2f}GB/s "
                f"{row[f'{name}_of_memcpy']:>4.0%}"
            )
        print(line)
    print(f"wrote {write_report(args.out, report)}")


if __name__ == "__main__":
    main()
