"""Profile every Tandem process under load: where each millisecond of a decode step goes.

Starts a stack with the HTTP front (default topology: 1 prefill + 1 decode worker, or
--both), drives it with vLLM's own client (`vllm bench serve`, concurrency 16 by default),
and while the load runs: samples every service with py-spy (one flame graph per service),
and reads each process's CPU time and run-queue wait from /proc, and the decode pool's step
count from the scheduler. The result, under bench/results/profiles/<label>/:

- `<service>.svg`: flame graph (py-spy samples of Python threads, idle excluded);
- `<service>.collapsed`: the raw stacks, for re-analysis;
- `summary.json` and the printed table: per service, CPU ms per decode step split by
  component (model, attention, sampler, protobuf, gRPC, scheduler bookkeeping,
  detokenization, HTTP, ...; `native threads` is CPU of threads py-spy does not see, such
  as torch's intra-op pool), and ms per step spent waiting for a core; each process's
  busiest threads; the host's busy, idle and steal CPU per step (every core, /proc/stat).

`--rate 0` runs no py-spy (its samplers take CPU from the load they measure): /proc
accounting only, for A/B runs of CPU per step.

    python -m bench.profile_serve --label before [--model llama-32m] [--both] [--rate 0]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.flamegraph import build_tree, parse_collapsed, render_svg
from bench.models import BENCH_MODELS, bench_model
from bench.peer_install import ensure_vllm
from bench.proc_stats import CpuSample, cpu_sample, host_sample, thread_samples, tree_sample
from bench.profile_categories import category_samples
from bench.vllm_client import Load, read_result, run_bench, start_bench
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "bench" / "results" / "profiles"
NATIVE = "native threads"
WAITING = "waiting for a core"


def pool_steps(scheduler_address: str) -> dict[str, tuple[int, float]]:
    """worker id -> (steps, total execute seconds) from the scheduler."""
    with grpc.insecure_channel(scheduler_address) as channel:
        stats = scheduler_pb2_grpc.SchedulerServiceStub(channel).GetPoolStats(
            scheduler_pb2.GetPoolStatsRequest(), timeout=10
        )
    return {p.worker_id: (p.steps, p.steps * p.mean_execute_ms / 1e3) for p in stats.pools}


def start_py_spy(pid: int, seconds: float, rate: int, out: Path) -> subprocess.Popen:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen(
        [
            py_spy,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(int(seconds)),
            "--rate",
            str(rate),
            "--format",
            "raw",
            "--nonblocking",
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def analyse(name: str, collapsed: Path, cpu: CpuSample, steps: int, rate: int) -> dict:
    """One service's row: CPU ms per decode step by component, plus waiting for a core."""
    if rate > 0:
        stacks = parse_collapsed(collapsed.read_text().splitlines()) if collapsed.is_file() else []
        counts = category_samples(stacks)
        per_step = {cat: 1e3 * n / rate / steps for cat, n in counts.most_common()}
        native = max(0.0, cpu.cpu_s - sum(counts.values()) / rate)
        per_step[NATIVE] = 1e3 * native / steps
        samples = sum(counts.values())
    else:  # --rate 0: nothing sampled, no split by component
        per_step = {"not sampled (--rate 0)": 1e3 * cpu.cpu_s / steps}
        samples = 0
    return {
        "service": name,
        "cpu_s": round(cpu.cpu_s, 3),
        "cpu_ms_per_step": round(1e3 * cpu.cpu_s / steps, 3),
        "waiting_ms_per_step": round(1e3 * cpu.wait_s / steps, 3),
        "samples": samples,
        "ms_per_step": {k: round(v, 3) for k, v in per_step.items()},
    }


def _busiest_threads(before: dict, after: dict, top: int = 4) -> list[tuple[str, float, float]]:
    """(name, CPU s, waiting s) of a process's busiest threads over the window."""
    rows = []
    for tid, (name, sample) in after.items():
        start = before.get(tid, (name, CpuSample(0.0, 0.0)))[1]
        delta = sample - start
        rows.append((f"{name}/{tid}", delta.cpu_s, delta.wait_s))
    return sorted(rows, key=lambda r: -r[1])[:top]


def format_table(summary: dict) -> str:
    rows = summary["services"]
    lines = [
        f"profile {summary['label']}: {summary['model']}, {summary['topology']}, "
        f"concurrency {summary['load']['concurrency']}",
        f"decode step interval {summary['step_interval_ms']:.2f} ms "
        f"(worker execute {summary['execute_ms']:.2f} ms), {summary['decode_steps']} steps in "
        f"{summary['window_s']:.1f} s; output {summary['result']['output_throughput']:.0f} tok/s",
        "pools in the window: "
        + ", ".join(
            f"{w} {p['steps']} steps of {p['execute_ms']:.1f} ms"
            for w, p in summary["pools"].items()
        ),
        "host CPU ms per decode step (all cores): "
        + ", ".join(f"{k} {v:.2f}" for k, v in summary["host_cpu_ms_per_step"].items()),
        "CPU ms per decode step by process and component:",
    ]
    for row in rows:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in row["ms_per_step"].items() if v >= 0.05)
        lines.append(
            f"  {row['service']:<16} cpu {row['cpu_ms_per_step']:6.2f}  "
            f"waiting {row['waiting_ms_per_step']:6.2f}  | {parts}"
        )
        if row.get("busiest_threads_ms_per_step"):
            lines.append(
                "      threads (cpu/waiting): "
                + ", ".join(
                    f"{n} {c:.1f}/{w:.1f}" for n, c, w in row["busiest_threads_ms_per_step"]
                )
            )
    return "\n".join(lines)


def wait_for_steps(scheduler_address: str, timeout_s: float) -> None:
    """Return once the pools run steps again: the client's start (importing vLLM takes
    seconds of CPU) must not fall inside the sampling window."""
    before = sum(steps for steps, _ in pool_steps(scheduler_address).values())
    deadline = time.monotonic() + timeout_s
    while sum(steps for steps, _ in pool_steps(scheduler_address).values()) <= before:
        if time.monotonic() > deadline:
            raise TimeoutError("the client sent no request")
        time.sleep(0.2)


def run(args: argparse.Namespace) -> dict:
    from services.stack.launcher import Stack, StackSpec

    vllm = ensure_vllm()
    model = str(bench_model(args.model))
    out_dir = PROFILES / args.label
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = StackSpec.on_free_ports(
        model,
        prefill=0 if args.both else 1,
        decode=0 if args.both else 1,
        both=1 if args.both else 0,
        http=True,
    )
    run_dir = Path(tempfile.mkdtemp(prefix=f"profile-{args.label}-"))
    env = dict(item.split("=", 1) for item in args.env)
    stack = Stack.start(spec, run_dir, env=env, exit_with_parent=True)
    base_url = f"http://{spec.http_address}"
    name = Path(model).name
    try:
        run_bench(vllm, base_url, name, model, Load(concurrency=4, num_prompts=8), 300)  # warm-up
        load = Load(concurrency=args.concurrency, num_prompts=args.num_prompts)
        result_file = out_dir / "client_result.json"
        client = start_bench(vllm, base_url, name, model, load, result_file)
        wait_for_steps(spec.scheduler_address, args.timeout_s)  # the client has started
        time.sleep(args.settle_s)
        pids = {p.name: p.pid for p in stack.processes}
        steps_before = pool_steps(spec.scheduler_address)
        cpu_before = {n: cpu_sample(pid) for n, pid in pids.items()}
        client_before = tree_sample(client.pid)
        host_before = host_sample()
        threads_before = {n: thread_samples(pid) for n, pid in pids.items()}
        started = time.perf_counter()
        if args.rate > 0:
            spies = {
                n: start_py_spy(pid, args.seconds, args.rate, out_dir / f"{n}.collapsed")
                for n, pid in pids.items()
            }
            for spy in spies.values():
                spy.wait()
        else:  # CPU accounting only: no sampler taking CPU from the load
            time.sleep(args.seconds)
        window = time.perf_counter() - started
        host = host_sample() - host_before
        threads = {
            n: _busiest_threads(threads_before[n], thread_samples(pid)) for n, pid in pids.items()
        }
        cpu = {n: cpu_sample(pid) - cpu_before[n] for n, pid in pids.items()}
        client_cpu = tree_sample(client.pid) - client_before
        steps_after = pool_steps(spec.scheduler_address)
        client.wait(timeout=args.timeout_s)
        result = read_result(result_file)
    finally:
        stack.stop()
    decoder = next(w for w in steps_after if w.startswith("decode") or w.startswith("both"))
    pools = {
        w: {
            "steps": steps_after[w][0] - steps_before[w][0],
            "execute_ms": round(
                1e3
                * (steps_after[w][1] - steps_before[w][1])
                / max(1, steps_after[w][0] - steps_before[w][0]),
                3,
            ),
        }
        for w in steps_after
    }
    steps = steps_after[decoder][0] - steps_before[decoder][0]
    execute = steps_after[decoder][1] - steps_before[decoder][1]
    if steps <= 0:
        raise RuntimeError("the decode pool ran no step in the profiling window")
    services = [analyse(n, out_dir / f"{n}.collapsed", cpu[n], steps, args.rate) for n in pids]
    for row in services:
        row["busiest_threads_ms_per_step"] = [
            [name, round(1e3 * c / steps, 3), round(1e3 * w / steps, 3)]
            for name, c, w in threads[row["service"]]
        ]
    services.append(
        {
            "service": "client (vllm bench)",
            "cpu_s": round(client_cpu.cpu_s, 3),
            "cpu_ms_per_step": round(1e3 * client_cpu.cpu_s / steps, 3),
            "waiting_ms_per_step": round(1e3 * client_cpu.wait_s / steps, 3),
            "samples": 0,
            "ms_per_step": {"vllm bench serve (not sampled)": 1e3 * client_cpu.cpu_s / steps},
        }
    )
    for n in pids:
        collapsed = out_dir / f"{n}.collapsed"
        if collapsed.is_file():
            tree = build_tree(parse_collapsed(collapsed.read_text().splitlines()), n)
            (out_dir / f"{n}.svg").write_text(render_svg(tree, f"{args.label}: {n}"))
    summary = {
        "label": args.label,
        "model": args.model,
        "topology": "both" if args.both else "1 prefill + 1 decode",
        "load": {
            "concurrency": args.concurrency,
            "num_prompts": args.num_prompts,
            "input_len": 128,
            "output_len": 128,
            "client": "vllm bench serve",
        },
        "window_s": round(window, 3),
        "decode_steps": steps,
        "step_interval_ms": round(1e3 * window / steps, 3),
        "execute_ms": round(1e3 * execute / steps, 3),
        "pools": pools,
        "host_cpu_ms_per_step": {
            "busy": round(1e3 * host.busy_s / steps, 3),
            "idle": round(1e3 * host.idle_s / steps, 3),
            "steal": round(1e3 * host.steal_s / steps, 3),
        },
        "env": env,
        "py_spy_rate_hz": args.rate,
        "cpus": __import__("os").cpu_count(),
        "result": result,
        "services": services,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.profile_serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--label", required=True, help="folder under bench/results/profiles")
    parser.add_argument("--model", default="llama-32m", choices=list(BENCH_MODELS))
    parser.add_argument("--both", action="store_true", help="one both-role worker")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--settle-s", type=float, default=6.0, help="load before sampling")
    parser.add_argument("--seconds", type=float, default=12.0, help="sampling window")
    parser.add_argument(
        "--rate",
        type=int,
        default=100,
        help="py-spy samples per second (0: CPU accounting only, no py-spy)",
    )
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of every service (repeatable), e.g. TANDEM_DTYPE=bfloat16",
    )
    summary = run(parser.parse_args(argv))
    print(format_table(summary))


if __name__ == "__main__":
    main()
