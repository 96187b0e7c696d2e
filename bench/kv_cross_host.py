"""KV-transfer latency and bandwidth between two hosts, UCX against a plain TCP stream of the
same bytes between the same two hosts, in the same run.

The hosts are the network namespaces of `services.stack.hosts.Fabric(2)` (host 0 -> veth ->
router namespace -> veth -> host 1, MTU 1500, all on this machine's cores). A receiver
process runs in host 1's namespace and a sender in host 0's (each started with `ip netns
exec`, so each really is in its namespace); per size and round they take turns on four
paths, interleaved so that every path sees the same machine load:

- `raw_tcp`: one Python TCP stream (opened once, as UCX's endpoint is), the bytes of a
  preallocated buffer sent with `sendall` in 1 MiB pieces (`--tcp-chunk`) and received with
  `recv_into` straight into a preallocated buffer; socket buffers are the kernel's
  autotuned defaults. One `sendall` of 64 MiB in a single call is much slower here
  (the sender holds the socket for the whole call and the stream stalls), so that
  variant is measured too but is not the reference:
- `raw_tcp_1call`: the same stream, one `sendall` of all bytes;
- `ucx_wire`: `UcxTransport.send` of a preallocated buffer to `UcxTransport.receive` into a
  reused staging buffer (peer-failure handling on, the default): UCX's part alone;
- `ucx_kv`: what a decode worker waits for when it receives KV from another host
  (`PeerKvConnector.send` / `.receive`, what a plan's KV load runs): the sender gathers its
  scattered source blocks (every other block of a `KvCache`) into a reused staging buffer
  on its tensor thread and sends it as one tagged message; the receiver, its receive posted
  before, gets it into its own staging buffer and scatters it into consecutive blocks on
  its tensor thread. Split
  into gather, message (gathered -> received) and scatter.

Each round is timed from "the sender starts" (the source bytes or blocks are final) to "the
bytes or blocks are in place at the receiver": both processes read the same monotonic
clock, so the receiver's end minus the sender's start is the latency. The receiver posts its
receive (or starts reading) and then says it is ready on a control connection; the sender
starts on that word. What arrived is checked bit for bit (SHA-256 against what was sent,
once per size and path). Blocks are of a Llama-3-8B-shaped bf16 pool with 8-token blocks (32
layers, 8 KV heads of 128: 1 MiB a block), so 1, 16 and 64 MiB are 1, 16 and 64 blocks.

UCX runs twice, each time in a fresh pair of processes with its own raw TCP reference:
`tuned` (the defaults of `services.worker.ucx_tuning`, as a worker gets them) and `untuned`
(the UCX library's own values for every setting that module changes, read from
`ucx_info -c`). Other UCX variables set in the environment apply to both runs
(`UCX_PROTO_INFO=used` prints the protocols used, to stderr). JSON goes to
bench/results/kv_cross_host.json: medians, ratios to raw TCP, every sample, versions, the
UCX environment of each run.

    python -m bench.kv_cross_host [--sizes 1 16 64] [--rounds 10] [--ucx tuned untuned]

Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MIB = 1 << 20
# A Llama-3-8B-shaped block of 8 tokens: 32 layers, 8 KV heads of 128, bf16 -> 1 MiB.
GEOMETRY = dict(block_size=8, num_layers=32, num_kv_heads=8, head_dim=128)
RAW = ("raw_tcp", "raw_tcp_1call")
UCX = ("ucx_wire", "ucx_kv")
PATHS = RAW + UCX
PARTS = ("gather", "message", "scatter")  # of ucx_kv
READY = b"R"
RESULT_MARK = '{"ucx_env"'  # the sender's result line on its stdout


# -- control connection: one-byte words and length-prefixed messages ----------------------
async def _send_msg(loop, sock: socket.socket, data: bytes) -> None:
    await loop.sock_sendall(sock, struct.pack("!I", len(data)) + data)


async def _recv_exact(loop, sock: socket.socket, n: int) -> bytes:
    chunks = b""
    while len(chunks) < n:
        got = await loop.sock_recv(sock, n - len(chunks))
        if not got:
            raise ConnectionError("control connection closed")
        chunks += got
    return chunks


async def _recv_msg(loop, sock: socket.socket) -> bytes:
    (n,) = struct.unpack("!I", await _recv_exact(loop, sock, 4))
    return await _recv_exact(loop, sock, n)


def _recv_into_all(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("data stream closed")
        got += k


def _digest(data) -> str:
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def _make_cache(num_blocks: int):
    import torch

    from services.worker.kv_cache import KvCache

    return KvCache(num_blocks=num_blocks, dtype=torch.bfloat16, **GEOMETRY)


def _block_digest(cache, blocks: list[int]) -> str:
    import torch

    return _digest(cache.data[blocks].contiguous().view(-1).view(torch.uint8).numpy())


def _source_blocks(count: int) -> list[int]:
    return list(range(0, 2 * count, 2))  # scattered, as a prefill worker's are


def _dest_blocks(count: int) -> list[int]:
    return list(range(1, count + 1))


# -- the two sides (each in its own namespace) ---------------------------------------------
def receiver(args) -> None:
    import numpy as np
    import torch

    from services.worker.kv_transfer import UcxTransport
    from services.worker.parallel.kv_message_io import StagingBuffers

    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(2)
    print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
    control, _ = listener.accept()  # the sender connects control first, then data
    data, _ = listener.accept()
    listener.close()
    control.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    control.setblocking(False)
    tensor_thread = ThreadPoolExecutor(max_workers=1)  # the worker's tensor thread
    cache = tensor_thread.submit(_make_cache, 2 * max(args.sizes) + 1).result()
    raw_buffer = np.zeros(max(args.sizes) * MIB, dtype=np.uint8)

    def scatter(blocks, buffer) -> None:
        cache.scatter_blocks(blocks, torch.from_numpy(buffer).view(len(blocks), -1))

    async def run() -> dict:
        loop = asyncio.get_running_loop()
        transport = UcxTransport(timeout_s=60.0)
        await _send_msg(loop, control, transport.address)
        staging = StagingBuffers()
        tag = 0
        out = {"ends": {}, "arrivals": {}, "digests": {}}
        for size in args.sizes:
            nbytes, dst = size * MIB, _dest_blocks(size)
            ends = {p: [] for p in PATHS}
            arrivals, digests = [], {}
            for r in range(args.rounds + 1):  # the first round warms up
                last = r == args.rounds  # what arrived is checked then (after the timing)
                for path in RAW:
                    view = memoryview(raw_buffer)[:nbytes]
                    await loop.sock_sendall(control, READY)
                    _recv_into_all(data, view)
                    ends[path].append(time.perf_counter())
                    if last:
                        digests[path] = _digest(view)
                for path in UCX:
                    tag += 1
                    buffer = staging.acquire(nbytes)
                    received = asyncio.ensure_future(
                        transport.receive(tag=tag, nbytes=nbytes, out=buffer)
                    )
                    await asyncio.sleep(0)  # posted in UCX before the sender is told
                    await loop.sock_sendall(control, READY)
                    await received
                    if path == "ucx_kv":
                        arrivals.append(time.perf_counter())
                        await asyncio.wrap_future(tensor_thread.submit(scatter, dst, buffer))
                    ends[path].append(time.perf_counter())
                    if last and path == "ucx_wire":
                        digests[path] = _digest(buffer)
                    staging.release(buffer)
            digests["ucx_kv"] = tensor_thread.submit(_block_digest, cache, dst).result()
            out["ends"][size], out["arrivals"][size] = ends, arrivals
            out["digests"][size] = digests
        await transport.close()
        return out

    result = asyncio.run(run())
    control.setblocking(True)
    payload = json.dumps(result).encode()
    control.sendall(struct.pack("!I", len(payload)) + payload)
    control.close()
    data.close()
    tensor_thread.shutdown()


def sender(args) -> None:
    import numpy as np
    import torch

    from services.worker.kv_transfer import UcxTransport
    from services.worker.parallel.kv_message_io import StagingBuffers

    control = socket.create_connection((args.peer, args.port))
    data = socket.create_connection((args.peer, args.port))
    control.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    control.setblocking(False)
    tensor_thread = ThreadPoolExecutor(max_workers=1)
    cache = tensor_thread.submit(_make_cache, 2 * max(args.sizes) + 1).result()

    def fill() -> None:
        generator = torch.Generator().manual_seed(0)
        cache.data.view(torch.int16).copy_(
            torch.randint(-30000, 30000, cache.data.shape, dtype=torch.int16, generator=generator)
        )

    tensor_thread.submit(fill).result()
    source = np.random.default_rng(1).integers(0, 256, max(args.sizes) * MIB, dtype=np.uint8)

    def gather(blocks, buffer) -> None:
        cache.gather_blocks(blocks, out=torch.from_numpy(buffer).view(len(blocks), -1))

    async def run() -> dict:
        loop = asyncio.get_running_loop()
        transport = UcxTransport(timeout_s=60.0)
        address = await _recv_msg(loop, control)
        staging = StagingBuffers()
        tag = 0
        starts, gathered = {}, {}
        for size in args.sizes:
            nbytes, src = size * MIB, _source_blocks(size)
            stream = memoryview(source)[:nbytes]
            times = {p: [] for p in PATHS}
            gathered[size] = []
            for _ in range(args.rounds + 1):
                assert await _recv_exact(loop, control, 1) == READY
                times["raw_tcp"].append(time.perf_counter())
                for offset in range(0, nbytes, args.tcp_chunk):
                    data.sendall(stream[offset : offset + args.tcp_chunk])
                assert await _recv_exact(loop, control, 1) == READY
                times["raw_tcp_1call"].append(time.perf_counter())
                data.sendall(stream)
                tag += 1
                assert await _recv_exact(loop, control, 1) == READY
                times["ucx_wire"].append(time.perf_counter())
                await transport.send("receiver", address, tag=tag, payload=source[:nbytes])
                tag += 1
                assert await _recv_exact(loop, control, 1) == READY
                times["ucx_kv"].append(time.perf_counter())
                buffer = staging.acquire(nbytes)
                await asyncio.wrap_future(tensor_thread.submit(gather, src, buffer))
                gathered[size].append(time.perf_counter())
                await transport.send("receiver", address, tag=tag, payload=buffer)
                staging.release(buffer)
            starts[size] = times
        received = json.loads(await _recv_msg(loop, control))
        await transport.close()
        out = {"ucx_env": _ucx_env(), "sizes": {}}
        for size in args.sizes:
            ends = received["ends"][str(size)]
            arrivals = received["arrivals"][str(size)]
            sent = _digest(source[: size * MIB])
            blocks = tensor_thread.submit(_block_digest, cache, _source_blocks(size)).result()
            expected = {"raw_tcp": sent, "raw_tcp_1call": sent, "ucx_wire": sent, "ucx_kv": blocks}
            entry = {
                p: {
                    "seconds": _spans(starts[size][p], ends[p]),
                    "bit_identical": received["digests"][str(size)][p] == expected[p],
                }
                for p in PATHS
            }
            entry["parts"] = {
                "gather": _spans(starts[size]["ucx_kv"], gathered[size]),
                "message": _spans(gathered[size], arrivals),
                "scatter": _spans(arrivals, ends["ucx_kv"]),
            }
            out["sizes"][size] = entry
        return out

    result = asyncio.run(run())
    print(json.dumps(result), flush=True)
    control.close()
    data.close()
    tensor_thread.shutdown()


def _spans(begins: list[float], ends: list[float]) -> list[float]:
    """end - begin per round, the warm-up round left out."""
    return [e - b for b, e in zip(begins, ends, strict=True)][1:]


def _ucx_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("UCX_", "UCXPY_"))}


# -- the driver (this machine's own namespace) -----------------------------------------------
def _ucx_library_defaults(keys) -> dict[str, str]:
    """The UCX library's own values for `keys` (`ucx_info -c` with no UCX_ variable set)."""
    import libucx

    base = Path(libucx.__file__).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["LD_LIBRARY_PATH"] = str(base / "lib")
    listing = subprocess.run(
        [str(base / "bin" / "ucx_info"), "-c"], capture_output=True, text=True, env=env
    ).stdout
    values = dict(line.split("=", 1) for line in listing.splitlines() if "=" in line)
    return {k: values[k] for k in keys}


def run_pair(fabric, args, env: dict[str, str]) -> dict:
    """One receiver on host 1, one sender on host 0; returns the sender's result."""
    common = ["--sizes", *map(str, args.sizes), "--rounds", str(args.rounds),
              "--tcp-chunk", str(args.tcp_chunk)]  # fmt: skip
    me = [sys.executable, "-m", "bench.kv_cross_host"]
    recv = subprocess.Popen(
        [*fabric.exec_prefix(1), *me, "--role", "receiver", *common],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    send = None
    try:
        port = json.loads(recv.stdout.readline())["port"]
        send = subprocess.Popen(
            [*fabric.exec_prefix(0), *me, "--role", "sender", *common,
             "--peer", fabric.hosts[1].address, "--port", str(port)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        out, _ = send.communicate(timeout=args.timeout)
        rest, _ = recv.communicate(timeout=30)
    finally:
        for proc in (send, recv):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    if send.returncode or recv.returncode:
        sys.exit(f"kv_cross_host: sender {send.returncode}, receiver {recv.returncode}")
    lines = out.splitlines() + rest.splitlines()
    chatter = [line for line in lines if line.strip() and not line.startswith(RESULT_MARK)]
    if chatter:  # e.g. UCX_PROTO_INFO's tables
        print("\n".join(chatter), file=sys.stderr)
    return json.loads(next(line for line in lines if line.startswith(RESULT_MARK)))


def _median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def summarize(result: dict, sizes: list[int]) -> list[dict]:
    rows = []
    for size in sizes:
        entry, nbytes = result["sizes"][str(size)], size * MIB
        row = {"mib": size, "bytes": nbytes}
        for p in PATHS:
            row[f"{p}_us"] = _median_us(entry[p]["seconds"])
            row[f"{p}_gbps"] = round(nbytes / row[f"{p}_us"] / 1e3, 3)
            row[f"{p}_bit_identical"] = entry[p]["bit_identical"]
        for part in PARTS:
            row[f"ucx_kv_{part}_us"] = _median_us(entry["parts"][part])
        for p in UCX:
            for raw in RAW:
                row[f"{p}_of_{raw}"] = round(row[f"{raw}_us"] / row[f"{p}_us"], 3)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64], help="MiB")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ucx", nargs="+", choices=["tuned", "untuned"],
                        default=["tuned", "untuned"], help="UCX settings to run with")  # fmt: skip
    parser.add_argument("--tcp-chunk", type=int, default=MIB, help="raw_tcp's sendall piece")
    parser.add_argument("--out", default=str(RESULTS / "kv_cross_host.json"))
    parser.add_argument("--timeout", type=float, default=170.0, help="per run, seconds")
    parser.add_argument("--role", choices=["receiver", "sender"], help=argparse.SUPPRESS)
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes = sorted(set(args.sizes))
    if args.role == "receiver":
        return receiver(args)
    if args.role == "sender":
        return sender(args)

    from services.stack.hosts import Fabric, unavailable
    from services.worker.ucx_tuning import SETTINGS

    why = unavailable()
    if why:
        sys.exit(f"kv_cross_host: {why}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    library_defaults = _ucx_library_defaults(SETTINGS)
    runs = {}
    with Fabric(2) as fabric:
        for name in args.ucx:
            run_env = {**env, **library_defaults} if name == "untuned" else env
            result = run_pair(fabric, args, run_env)
            runs[name] = {
                "ucx_env": result["ucx_env"],
                "rows": summarize(result, args.sizes),
                "samples": result["sizes"],
            }

    import libucx
    import numpy
    import torch
    import ucxx

    from bench.report import load_average, write_report

    report = {
        "benchmark": "kv_cross_host",
        "what": "sender starts (source final) -> bytes / blocks in place at the receiver, "
        "host 0 -> host 1 network namespaces (veth through a router namespace), median",
        "paths": {
            "raw_tcp": f"one Python TCP stream, sendall in {args.tcp_chunk} B pieces / "
            "recv_into a preallocated buffer, kernel-default socket buffers",
            "raw_tcp_1call": "the same stream, one sendall of all bytes",
            "ucx_wire": "UcxTransport.send of a buffer -> UcxTransport.receive into staging",
            "ucx_kv": "gather blocks into staging, UcxTransport.send -> receive into staging, "
            "scatter into blocks (tensor threads); parts: gather, message, scatter",
        },
        "ucx_runs": {
            "tuned": "services.worker.ucx_tuning's defaults, as a worker gets them",
            "untuned": f"UCX library defaults for those settings: {library_defaults}",
        },
        "geometry": {**GEOMETRY, "dtype": "bfloat16", "block_bytes": MIB},
        "rounds": args.rounds,
        "runs": runs,
        "versions": {
            "ucxx": ucxx.__version__,
            "libucx": libucx.__version__,
            "torch": torch.__version__,
            "numpy": numpy.__version__,
            "python": platform.python_version(),
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_1m": load_average(),
        },
    }
    print(f"raw TCP: sendall in {args.tcp_chunk >> 10} KiB pieces (1call: one sendall); "
          "ratio: raw_tcp latency / ucx_kv latency")  # fmt: skip
    header = (
        f"{'ucx':>8} {'MiB':>4} {'raw_tcp':>17} {'raw_tcp_1call':>17} {'ucx_wire':>17} "
        f"{'ucx_kv':>17} {'gather':>7} {'message':>8} {'scatter':>8} {'ratio':>6}"
    )
    print(header)
    for name, run in runs.items():
        for row in run["rows"]:
            line = f"{name:>8} {row['mib']:>4}"
            for p in PATHS:
                mark = " " if row[f"{p}_bit_identical"] else "!"
                line += f" {row[f'{p}_us'] / 1e3:>7.2f}ms {row[f'{p}_gbps']:>5.2f}G{mark}"
            for part, width in zip(PARTS, (7, 8, 8), strict=True):
                line += f" {row[f'ucx_kv_{part}_us'] / 1e3:>{width - 2}.1f}ms"
            line += f" {row['ucx_kv_of_raw_tcp']:>6.0%}"
            print(line)
    print("(! : not bit-identical)")
    print(f"wrote {write_report(args.out, report)}")


if __name__ == "__main__":
    main()
