"""Throughput of the KV offload's disk tier (`services.worker.kv_offload`), 1 MiB blocks:
put (header, CRC-32, temporary file, rename) / get (read, verify). Also the checksums the
disk format could use, on the same blocks (why it uses CRC-32).

The disk numbers are through the page cache (a read follows the write by a moment; the
box's memory, not its disk, bounds them): what a worker sees while its disk tier's recent
blocks are still cached. Each measurement is the median of a few rounds of `--blocks`
blocks; the whole run takes a few seconds. JSON goes to
bench/results/kv_offload_io_cpu.json.

    python -m bench.kv_offload_io [--blocks 64] [--rounds 3] [--dir /tmp/somewhere]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch

from bench.report import write_report
from common.prefix_hash import block_hash, root_hash
from services.worker.kv_offload.disk_tier import DiskTier
from services.worker.kv_offload.keys import BlockKey, TierIdentity

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_BYTES = 1 << 20
ROOT = root_hash(b"bench")


def keys(count: int, round_: int) -> list[BlockKey]:
    return [BlockKey(block_hash(ROOT, [round_, i])) for i in range(count)]


def rate(seconds: list[float], count: int) -> float:
    """MB/s (10^6 bytes) of the median round."""
    return round(count * BLOCK_BYTES / statistics.median(seconds) / 1e6, 1)


def timed(method, names: list[BlockKey], args: list) -> float:
    """Seconds to call `method(key, ROOT, arg)` for each key, in order."""
    start = time.perf_counter()
    for name, arg in zip(names, args, strict=True):
        method(name, ROOT, arg)
    return time.perf_counter() - start


def timed_gets(method, names: list[BlockKey], out: torch.Tensor) -> float:
    start = time.perf_counter()
    for name in names:
        if method(name, ROOT, out=out) is None:
            raise AssertionError("a block just stored was a miss")
    return time.perf_counter() - start


def bench_disk(blocks: list[torch.Tensor], rounds: int, folder: str) -> dict:
    count = len(blocks)
    identity = TierIdentity("bench", 1, 16, BLOCK_BYTES, "torch.uint8")
    disk = DiskTier(folder, count * (BLOCK_BYTES + 128), identity)
    out = torch.empty(BLOCK_BYTES, dtype=torch.uint8)
    puts, gets = [], []
    for round_ in range(rounds):
        names = keys(count, round_)
        puts.append(timed(disk.put, names, blocks))
        gets.append(timed_gets(disk.get, names, out))
    if not torch.equal(disk.get(names[-1], ROOT), blocks[-1]):
        raise AssertionError("the disk tier served other bytes than it was given")
    return {"put_MBps": rate(puts, count), "get_MBps": rate(gets, count)}


def bench_checksums(blocks: list[torch.Tensor], rounds: int) -> dict:
    views = [memoryview(b.numpy()) for b in blocks]
    sums = {
        "crc32": zlib.crc32,
        "blake2b_128": lambda view: hashlib.blake2b(view, digest_size=16).digest(),
        "sha256": lambda view: hashlib.sha256(view).digest(),
    }
    results = {}
    for name, checksum in sums.items():
        seconds = []
        for _ in range(rounds):
            start = time.perf_counter()
            for view in views:
                checksum(view)
            seconds.append(time.perf_counter() - start)
        results[f"{name}_MBps"] = rate(seconds, len(views))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=64, help="1 MiB blocks per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="the disk tier's folder (default: a temp)")
    parser.add_argument("--out", default=str(RESULTS / "kv_offload_io_cpu.json"))
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    blocks = [
        torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=generator)
        for _ in range(args.blocks)
    ]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kv-offload-bench-") as folder:
        results = {
            "disk": bench_disk(blocks, args.rounds, folder),
            "checksum": bench_checksums(blocks, args.rounds),
        }
    report = {
        "block_bytes": BLOCK_BYTES,
        "blocks_per_round": args.blocks,
        "rounds": args.rounds,
        "results": results,
        "note": "MB/s = 10^6 bytes/s, median round; disk through a warm page cache",
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
    }
    for tier, numbers in results.items():
        print(tier, "  ".join(f"{name} {value}" for name, value in numbers.items()))
    print("wrote", write_report(args.out, report))


if __name__ == "__main__":
    main()
