"""Serving benchmark: a stream of requests against Tandem's Generate API, with latency
percentiles (TTFT, ITL, TPOT, end to end), throughput, prefix-cache hit rate, and HF
`generate` on the same prompts as a static-batching baseline.

Starts the whole stack (gateway, scheduler, prefill + decode workers as processes on free
loopback ports) unless --address points at a running gateway. Requests come from
`bench/workloads.py` (`mixed` or `shared-prefix`) and are sent by concurrent streaming gRPC
clients (one asyncio loop): Poisson arrivals at --request-rate (`inf` = all at once) or a
closed loop of --concurrency requests in flight (the default, 8). Metrics are defined in
`bench/metrics.py`. --compare-prefix-cache runs the same workload on a stack with prefix
caching on and on one with it off, and reports both TTFTs and their ratio.

The HF baseline loads the same checkpoint with `AutoModelForCausalLM` (fp32, greedy) in this
process after the stack is stopped, and runs the requests in arrival order as left-padded
static batches of the concurrency (8 with a request rate), each batch generating up to the
largest max_tokens in it. It only counts each request's useful tokens: its own max_tokens,
capped by what Tandem produced for it and by the row's own EOS.

Prints a table, writes JSON (default bench/results/serve_<workload>.json).

    python -m bench.serve [--workload mixed|shared-prefix] [--num-requests N]
        [--request-rate R | --concurrency C] [--compare-prefix-cache] [--plot out.png]
    python -m bench.serve --address 127.0.0.1:50051 --no-hf-baseline
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.hf_baseline import hf_baseline
from bench.metrics import RequestRecord, per_request_rows, summarize
from bench.report import (
    format_table,
    hf_ratios,
    load_average,
    machine_info,
    prefix_cache_comparison,
    sampling_comparison,
    summary_lines,
    write_plot,
)
from bench.serve_client import SAMPLING_MODES, model_info, run_client, warm_up
from bench.workloads import (
    WORKLOADS,
    BenchRequest,
    MixedParams,
    SharedPrefixParams,
    arrival_offsets,
    build_workload,
    check_fits,
    length_summary,
    usable_token_ids,
)
from common.pb.tandem.v1 import generate_pb2

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DEFAULT_MODEL_DIR = ROOT / ".tandem" / "models" / "tandem-tiny-llama"
DEFAULT_CONCURRENCY = 8
HF_BATCH_WITH_RATE = 8
COMPARE_RUNS = (("prefix_cache_on", "true"), ("prefix_cache_off", "false"))
COMPARE_SAMPLING_RUNS = (("greedy", "greedy"), ("full_sampling", "full"))


@dataclass(frozen=True)
class BenchConfig:
    """Everything one benchmark run depends on; `parse_args` builds it from the CLI."""

    model: str = ""  # model folder; "" = the embedded default model
    address: str = ""  # running gateway; "" = start a stack
    workload: str = "mixed"
    num_requests: int | None = None  # None = the workload's default
    request_rate: float | None = None  # Poisson arrivals (req/s, inf = all at once)
    concurrency: int | None = None  # closed loop; default 8 when no rate is given
    prefill: int = 1
    decode: int = 1
    both: int = 0
    seed: int = 0
    compare_prefix_cache: bool = False
    # "greedy", or "full": every sampling feature on (bench/serve_client.py FULL_SAMPLING).
    sampling: str = "greedy"
    compare_sampling: bool = False  # run greedy and full sampling, each on its own stack
    hf_baseline: bool = True
    plot: str = ""
    out: str = ""
    # Workload shape overrides (None = the defaults in bench/workloads.py).
    prompt_len: tuple[int, int] | None = None
    prompt_len_median: float | None = None
    output_len: tuple[int, int] | None = None
    prefix_len: int | None = None
    suffix_len: tuple[int, int] | None = None
    num_groups: int | None = None
    request_timeout_s: float = 600.0
    ready_timeout_s: float = 300.0
    run_dir: str = ""  # where started stacks keep their logs; "" = a temporary folder
    progress: bool = True

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.request_rate is not None and self.concurrency is not None:
            raise ValueError("use either request_rate or concurrency, not both")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.sampling not in SAMPLING_MODES:
            raise ValueError(f"sampling must be one of {SAMPLING_MODES}, got {self.sampling!r}")
        if self.compare_sampling and self.compare_prefix_cache:
            raise ValueError("compare either sampling or prefix caching, not both")
        if self.compare_prefix_cache and self.address:
            raise ValueError(
                "compare_prefix_cache starts its own stacks (prefix caching on and off); "
                "it cannot be combined with address"
            )

    @property
    def effective_concurrency(self) -> int | None:
        """Requests in flight at most; None = unbounded (arrivals at a rate)."""
        if self.request_rate is None:
            return self.concurrency or DEFAULT_CONCURRENCY
        return None

    @property
    def hf_batch_size(self) -> int:
        return self.effective_concurrency or HF_BATCH_WITH_RATE


# -- workload ------------------------------------------------------------------------------


def workload_params(config: BenchConfig) -> MixedParams | SharedPrefixParams:
    """The workload's default parameters with the config's overrides applied."""
    overrides: dict = {}
    if config.num_requests is not None:
        overrides["num_requests"] = config.num_requests
    if config.output_len is not None:
        overrides["output_len_range"] = tuple(config.output_len)
    if config.workload == "mixed":
        if config.prompt_len is not None:
            overrides["prompt_len_range"] = tuple(config.prompt_len)
        if config.prompt_len_median is not None:
            overrides["prompt_len_median"] = config.prompt_len_median
        return replace(MixedParams(), **overrides)
    if config.prefix_len is not None:
        overrides["prefix_len"] = config.prefix_len
    if config.suffix_len is not None:
        overrides["suffix_len_range"] = tuple(config.suffix_len)
    if config.num_groups is not None:
        overrides["num_groups"] = config.num_groups
    return replace(SharedPrefixParams(), **overrides)


def resolve_model(config: BenchConfig) -> str:
    if config.model:
        return config.model
    from devtools.checkpoint_builder import build_default_model

    return str(build_default_model(DEFAULT_MODEL_DIR))


# -- client --------------------------------------------------------------------------------


# -- stack ---------------------------------------------------------------------------------


@contextmanager
def target(
    config: BenchConfig, model: str, label: str, scheduler_args: Sequence[str]
) -> Iterator[str]:
    """The gateway address to benchmark: --address, or a stack started (and stopped) here."""
    if config.address:
        yield config.address
        return
    from services.stack.launcher import Stack, StackSpec

    prefill, decode = (0, 0) if config.both else (config.prefill, config.decode)
    spec = StackSpec.on_free_ports(
        model,
        prefill=prefill,
        decode=decode,
        both=config.both,
        extra_args={"scheduler": list(scheduler_args)},
    )
    if config.run_dir:
        run_dir = Path(config.run_dir) / label
    else:
        run_dir = Path(tempfile.mkdtemp(prefix=f"bench-serve-{label}-"))
    stack = Stack.start(
        spec, run_dir, ready_timeout_s=config.ready_timeout_s, exit_with_parent=True
    )
    try:
        yield spec.gateway_address
    finally:
        stack.stop()


def tandem_runs(config: BenchConfig) -> list[tuple[str, list[str], str]]:
    """(label, scheduler flags, sampling mode) of every Tandem run."""
    if config.compare_prefix_cache:
        return [
            (label, ["--enable-prefix-caching", on], config.sampling) for label, on in COMPARE_RUNS
        ]
    if config.compare_sampling:
        return [(label, [], mode) for label, mode in COMPARE_SAMPLING_RUNS]
    return [("tandem", [], config.sampling)]


# -- HF baseline ---------------------------------------------------------------------------


# -- report --------------------------------------------------------------------------------


# -- the benchmark -------------------------------------------------------------------------


def _config_json(config: BenchConfig, model: str) -> dict:
    out = asdict(config)
    out["model"] = model
    out["request_rate"] = None if config.request_rate is None else str(config.request_rate)
    out["effective_concurrency"] = config.effective_concurrency
    out["hf_batch_size"] = config.hf_batch_size
    return out


def _workload_json(
    config: BenchConfig, params: MixedParams | SharedPrefixParams, requests: list[BenchRequest]
) -> dict:
    if config.request_rate is None:
        arrival = f"closed loop, {config.effective_concurrency} requests in flight at most"
    elif math.isinf(config.request_rate):
        arrival = "all requests at once (request rate inf)"
    else:
        arrival = f"Poisson arrivals at {config.request_rate} requests/s"
    return {
        "name": config.workload,
        "params": asdict(params),
        "seed": config.seed,
        "arrival": arrival,
        "num_requests": len(requests),
        "prompt_tokens": length_summary([len(r.prompt_ids) for r in requests]),
        "max_tokens": length_summary([r.max_tokens for r in requests]),
    }


def _default_out(config: BenchConfig) -> Path:
    return RESULTS / f"serve_{config.workload.replace('-', '_')}.json"


@dataclass
class TandemResults:
    """The workload and what every Tandem run of it measured."""

    requests: list[BenchRequest]
    info: generate_pb2.GetModelInfoResponse
    summaries: dict[str, dict]
    records: dict[str, list[RequestRecord]]


def run_tandem(
    config: BenchConfig, model: str, tokenizer: Any, params: MixedParams | SharedPrefixParams
) -> TandemResults:
    """Every Tandem run of the workload (one, or prefix caching on and off), each on its own
    stack unless --address; the workload is built once, against the served model's limits."""
    offsets = None
    requests: list[BenchRequest] = []
    summaries: dict[str, dict] = {}
    records_by_run: dict[str, list[RequestRecord]] = {}
    info = None
    for label, scheduler_args, sampling in tandem_runs(config):
        with target(config, model, label, scheduler_args) as address:
            info = model_info(address)
            vocab = usable_token_ids(tokenizer, info.vocab_size)
            if not requests:
                requests = build_workload(config.workload, vocab, params, config.seed)
                check_fits(requests, info.max_model_len)
                if config.request_rate is not None:
                    offsets = arrival_offsets(len(requests), config.request_rate, config.seed)
            warm_up(address, vocab)
            load_before = load_average()
            records, wall = run_client(
                address,
                requests,
                offsets,
                config.effective_concurrency,
                f"bench-serve-{label}-{uuid.uuid4().hex}",
                config.request_timeout_s,
                label,
                config.progress,
                sampling,
            )
        records_by_run[label] = records
        summaries[label] = {
            **summarize(records, wall),
            "load_avg_1m_before": load_before,
            "per_request": per_request_rows(records),
        }
    assert info is not None
    return TandemResults(requests, info, summaries, records_by_run)


def run_hf(
    config: BenchConfig, model: str, tokenizer: Any, tandem: TandemResults, label: str
) -> dict:
    """The HF baseline on the workload, capped by what Tandem's `label` run produced."""
    produced = [0] * len(tandem.requests)
    for record in tandem.records[label]:
        produced[record.index] = record.output_tokens
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id or 0
    load_before = load_average()
    result = hf_baseline(model, tandem.requests, produced, config.hf_batch_size, pad_id)
    return {**result, "load_avg_1m_before": load_before}


def report_notes(config: BenchConfig, model: str, tandem: TandemResults, label: str) -> list[str]:
    notes = [
        "Tandem: greedy, token-id prompts, output tokens = tokens actually received "
        "(random-weight models may stop at EOS before max_tokens); streams over one gRPC "
        "channel from one asyncio client in this process; one warm-up pair of requests "
        "per stack, not measured. load_avg_1m_before: the machine's 1-minute load "
        "average as each phase started; above the CPU count, other processes competed.",
        "ITL: per token arrival; a message with k tokens arriving g after the previous "
        "one counts as k samples of g/k. TPOT: (last - first token time) / (tokens - 1).",
    ]
    if config.address and tandem.info.model_name != Path(model).name:
        notes.append(
            f"The gateway serves {tandem.info.model_name!r} but prompts and the HF baseline "
            f"use {model}: pass the served model's folder with --model."
        )
    if not config.hf_baseline:
        return notes
    if config.request_rate is not None and not math.isinf(config.request_rate):
        notes.append(
            "With a finite request rate Tandem's throughput is bounded by the offered "
            "load while HF runs flat out: the ratio then understates Tandem; use "
            "--concurrency or --request-rate inf to compare throughput."
        )
    notes.append(
        "HF baseline: transformers AutoModelForCausalLM fp32 greedy in this process after "
        "the stack stopped; requests in arrival order as left-padded static batches of "
        f"{config.hf_batch_size}, max_new_tokens = the largest max_tokens of the batch; "
        "useful output per request = min(its max_tokens, tokens Tandem produced for it "
        f"in the {label!r} run, the row's tokens up to its EOS); the ratio compares that "
        "run's tokens/s with HF's."
    )
    return notes


def run_benchmark(config: BenchConfig) -> dict:
    """Run the whole benchmark for `config`, write the JSON (and plot), return the report."""
    from transformers import AutoTokenizer

    model = resolve_model(config)
    tokenizer = AutoTokenizer.from_pretrained(model)
    params = workload_params(config)
    tandem = run_tandem(config, model, tokenizer, params)
    primary = next(iter(tandem.summaries))
    report: dict = {
        "benchmark": "serve",
        "config": _config_json(config, model),
        "model": {
            "path": model,
            "name": tandem.info.model_name,
            "vocab_size": tandem.info.vocab_size,
            "max_model_len": tandem.info.max_model_len,
        },
        "machine": machine_info(),
        "workload": _workload_json(config, params, tandem.requests),
        "tandem": tandem.summaries,
        "primary_run": primary,
        "notes": report_notes(config, model, tandem, primary),
        "hf_baseline": None,
        "ratio_tandem_over_hf": None,
    }
    if config.compare_prefix_cache:
        report["prefix_cache_comparison"] = prefix_cache_comparison(
            tandem.summaries["prefix_cache_on"], tandem.summaries["prefix_cache_off"]
        )
    if config.compare_sampling:
        report["sampling_comparison"] = sampling_comparison(
            tandem.summaries["greedy"], tandem.summaries["full_sampling"]
        )
    if config.hf_baseline:
        report["hf_baseline"] = run_hf(config, model, tokenizer, tandem, primary)
        report["ratio_tandem_over_hf"] = hf_ratios(tandem.summaries[primary], report["hf_baseline"])
    out = Path(config.out) if config.out else _default_out(config)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    report["json_path"] = str(out)
    if config.plot:
        report["plot_message"] = write_plot(config.plot, tandem.records, report)
    return report


# -- CLI -----------------------------------------------------------------------------------


def _rate(value: str) -> float:
    rate = float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {value}")
    return rate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default="", help="model folder (default: the embedded model)")
    add("--address", default="", help="benchmark a running gateway HOST:PORT (no stack start)")
    add("--workload", default="mixed", choices=WORKLOADS)
    add("--num-requests", type=int, help="requests (default: mixed 200, shared-prefix 64)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--request-rate", type=_rate, help="Poisson arrivals, requests/s (inf: all at once)"
    )
    load.add_argument(
        "--concurrency", type=int, help=f"closed loop, at most C in flight ({DEFAULT_CONCURRENCY})"
    )
    add("--prefill", type=int, default=1, help="prefill workers of the started stack")
    add("--decode", type=int, default=1, help="decode workers of the started stack")
    add("--both", type=int, default=0, help="both-role workers instead of prefill + decode")
    add("--seed", type=int, default=0, help="workload and arrival seed")
    add(
        "--compare-prefix-cache",
        action="store_true",
        help="run on a stack with prefix caching on and on one with it off; compare TTFT",
    )
    add("--sampling", default="greedy", choices=SAMPLING_MODES, help="per-request settings")
    add(
        "--compare-sampling",
        action="store_true",
        help="run greedy and full sampling (penalties, top-k/p, min-p, seed, logprobs, stop "
        "string) on fresh stacks; compare throughput and latency",
    )
    add(
        "--hf-baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run HF generate on the same prompts (static batches)",
    )
    add("--plot", default="", help="write a PNG plot here (needs matplotlib)")
    add("--out", default="", help="JSON path (default bench/results/serve_<workload>.json)")
    shape = parser.add_argument_group("workload shape (defaults in bench/workloads.py)")
    shape.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    shape.add_argument("--prompt-len-median", type=float, help="mixed: log-normal median")
    shape.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    shape.add_argument("--prefix-len", type=int, help="shared-prefix: tokens of each prefix")
    shape.add_argument("--suffix-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    shape.add_argument("--num-groups", type=int, help="shared-prefix: number of prefixes")
    add("--request-timeout", type=float, default=600.0, help="seconds per request")
    add("--no-progress", action="store_true", help="no progress bar")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.both and (args.prefill != 1 or args.decode != 1):
        parser.error("use either --both N or --prefill N --decode M")

    def pair(value: list[int] | None) -> tuple[int, int] | None:
        return None if value is None else (value[0], value[1])

    try:
        return BenchConfig(
            model=args.model,
            address=args.address,
            workload=args.workload,
            num_requests=args.num_requests,
            request_rate=args.request_rate,
            concurrency=args.concurrency,
            prefill=args.prefill,
            decode=args.decode,
            both=args.both,
            seed=args.seed,
            compare_prefix_cache=args.compare_prefix_cache,
            sampling=args.sampling,
            compare_sampling=args.compare_sampling,
            hf_baseline=args.hf_baseline,
            plot=args.plot,
            out=args.out,
            prompt_len=pair(args.prompt_len),
            prompt_len_median=args.prompt_len_median,
            output_len=pair(args.output_len),
            prefix_len=args.prefix_len,
            suffix_len=pair(args.suffix_len),
            num_groups=args.num_groups,
            request_timeout_s=args.request_timeout,
            progress=not args.no_progress,
        )
    except ValueError as error:
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    started = time.perf_counter()
    report = run_benchmark(config)
    print(format_table(report))
    for line in summary_lines(report):
        print(line)
    if report.get("plot_message"):
        print(report["plot_message"])
    print(f"benchmark took {time.perf_counter() - started:.1f}s")
    print(f"wrote {report['json_path']}")


if __name__ == "__main__":
    main()
