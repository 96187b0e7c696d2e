"""Multi-turn chat against the host-memory KV offload tier (issue 45): what
`--kv-offload-cpu-bytes` buys when the conversations' working set outgrows the KV pool.

`multiturn`: C conversations of T turns; turn k's prompt is a shared system prompt, the
whole history (every earlier user message and the model's answer to it) and a new user
message; answers are greedy, `max_tokens` long (EOS ignored). A conversation sends its
next turn as soon as its answer is in, and at most `--max-in-flight` turns run at once
(the others' users are "thinking"), so turns go round the conversations and between two
turns of one, the others' turns evict its history from a deliberately small device pool
(`--num-blocks`; by default just enough for the turns in flight). `unique`: the same
schedule and prompt lengths, every prompt fresh random tokens: nothing to gain, so it
shows what the tier's write-through costs.

Each workload runs twice on fresh stacks (one `both` worker, or with `--topology pd` a
prefill worker with the pool and the tier beside a decode worker): offload off, then on (a
tier that holds every conversation). Reported per run: TTFT of returning
turns (k >= 2) and of first turns, total tokens/s, and from the pool's stats the prompt
tokens computed, served from the device prefix cache and loaded from the tier; the on/off
ratios; and whether every answer is the same token for token in both runs. Prints a
table, writes JSON (default bench/results/multiturn_offload_cpu.json); exits 1 if an
answer differs or a turn failed.

    python -m bench.multiturn [--model llama-32m|smollm2-135m|FOLDER]
        [--workload all|multiturn|unique] [--conversations 8] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from transformers import AutoTokenizer

from bench.load_runs import bench_stack, pool_stats
from bench.metrics import RequestRecord, distribution_ms, e2e_s, summarize, ttft_s
from bench.models import BENCH_MODELS, bench_model
from bench.report import load_average, machine_info, write_report
from bench.serve_client import warm_up
from bench.workloads import usable_token_ids
from common.pb.tandem.internal.v1 import types_pb2
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = ("multiturn", "unique")
TOPOLOGIES = ("both", "pd")
MODES = (("offload_off", False), ("offload_on", True))
POOL_COUNTERS = (
    "prompt_tokens_computed",
    "prefix_hit_tokens",
    "offload_hit_tokens",
    "offload_saved_blocks",
    "offload_loaded_blocks",
    "evictions",
    "preemptions",
)
SPARE_BLOCKS = 4  # auto pool: the turns in flight at their longest, plus these


@dataclass(frozen=True)
class Config:
    """Everything a run depends on; `parse_args` builds it from the command line."""

    model: str = "llama-32m"  # a bench model's name (bench/models.py) or a folder
    workloads: tuple[str, ...] = WORKLOADS
    conversations: int = 8
    turns: int = 4
    system_len: int = 64
    user_len: int = 64
    max_tokens: int = 32
    max_in_flight: int = 2
    topology: str = "both"  # one `both` worker, or "pd": a prefill and a decode worker
    block_size: int = 16
    num_blocks: int = 0  # 0: the turns in flight at their longest + SPARE_BLOCKS
    offload_bytes: str = "512MiB"
    seed: int = 0
    request_timeout_s: float = 300.0
    out: str = str(RESULTS / "multiturn_offload_cpu.json")

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "user_len", "max_tokens", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if unknown := set(self.workloads) - set(WORKLOADS):
            raise ValueError(f"unknown workloads {sorted(unknown)}; known: {WORKLOADS}")

    def prompt_len(self, turn: int) -> int:
        """Tokens of turn `turn`'s prompt (0-based): system, every earlier exchange, a
        new user message."""
        return self.system_len + (turn + 1) * self.user_len + turn * self.max_tokens

    @property
    def history_blocks(self) -> int:
        """Full blocks of one conversation's history after its last answer."""
        return self.longest_turn // self.block_size

    @property
    def longest_turn(self) -> int:
        """Tokens of the last turn, its answer included (the workers' max_model_len)."""
        return self.prompt_len(self.turns - 1) + self.max_tokens

    @property
    def pool_blocks(self) -> int:
        if self.num_blocks:
            return self.num_blocks
        longest = -(-self.longest_turn // self.block_size)
        return self.max_in_flight * longest + SPARE_BLOCKS

    @property
    def working_set_blocks(self) -> int:
        """Distinct full blocks of every conversation's final history (the system
        prompt's counted once)."""
        system = self.system_len // self.block_size
        return system + self.conversations * (self.history_blocks - system)


# -- workload ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    index: int
    system: tuple[int, ...]
    users: tuple[tuple[int, ...], ...]  # one new message per turn
    fresh: tuple[tuple[int, ...], ...] = ()  # `unique`: a whole prompt per turn instead


def build_conversations(config: Config, vocab: Sequence[int], workload: str) -> list[Conversation]:
    """The conversations of `workload`, deterministic for the config's seed."""
    rng = random.Random(f"{config.seed}-{workload}")
    system = tuple(rng.choices(vocab, k=config.system_len))
    out = []
    for index in range(config.conversations):
        users = tuple(tuple(rng.choices(vocab, k=config.user_len)) for _ in range(config.turns))
        fresh = ()
        if workload == "unique":
            fresh = tuple(
                tuple(rng.choices(vocab, k=config.prompt_len(t))) for t in range(config.turns)
            )
        out.append(Conversation(index, system, users, fresh))
    return out


def reusable_tokens(config: Config, conversation: Conversation, turn: int) -> int:
    """Prompt tokens of a turn that earlier turns computed, in full blocks: the previous
    turn's prompt and answer but its last token (sampled, never fed back), or on a first
    turn the system prompt; none in `unique`. What a cache that forgets nothing serves."""
    if conversation.fresh:
        return 0
    if turn == 0:
        known = config.system_len
    else:
        known = config.prompt_len(turn - 1) + config.max_tokens - 1
    return known // config.block_size * config.block_size


def turn_prompt(
    conversation: Conversation, turn: int, answers: Sequence[Sequence[int]]
) -> list[int]:
    """Turn `turn`'s prompt: the system prompt, each earlier user message and its answer,
    the new user message (`unique`: its own fresh prompt)."""
    if conversation.fresh:
        return list(conversation.fresh[turn])
    ids = list(conversation.system)
    for user, answer in zip(conversation.users[:turn], answers, strict=True):
        ids += [*user, *answer]
    return ids + list(conversation.users[turn])


# -- client --------------------------------------------------------------------------------


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


@dataclass
class Turn:
    conversation: int
    turn: int
    record: RequestRecord
    reusable_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)

    def row(self) -> dict:
        r = self.record
        return {
            "conversation": self.conversation,
            "turn": self.turn + 1,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "reusable_tokens": self.reusable_tokens,
            "ttft_ms": _ms(ttft_s(r)),
            "e2e_ms": _ms(e2e_s(r)),
            "error": r.error,
        }


def turn_request(prompt: list[int], max_tokens: int, salt: str) -> generate_pb2.GenerateRequest:
    message = generate_pb2.GenerateRequest(max_tokens=max_tokens, cache_salt=salt)
    message.token_ids.ids.extend(prompt)
    message.sampling.temperature = 0.0
    message.stopping.ignore_eos = True
    return message


async def stream_turn(stub, message, turn: Turn, start: float, timeout_s: float) -> None:
    """Send one turn and record what came back (as `bench.serve_client` does)."""
    record = turn.record
    record.send_s = time.perf_counter() - start
    try:
        async for response in stub.Generate(message, timeout=timeout_s):
            if response.token_ids:
                record.message_s.append(time.perf_counter() - start)
                record.message_tokens.append(len(response.token_ids))
                turn.token_ids.extend(response.token_ids)
            if response.HasField("usage"):
                record.usage_prompt_tokens = response.usage.prompt_tokens
                record.cached_tokens = response.usage.cached_tokens
            if response.finish_reason:
                record.finish_reason = generate_pb2.FinishReason.Name(response.finish_reason)
        record.end_s = time.perf_counter() - start
    except grpc.aio.AioRpcError as error:
        record.error = f"{error.code().name}: {error.details()}"


async def converse(stub, conversation, config, gate, salt, start, out: list[Turn]) -> None:
    """One conversation's turns in order, each waiting for a slot among those in flight;
    stops at a failed turn (its history would be wrong)."""
    answers: list[list[int]] = []
    for k in range(config.turns):
        prompt = turn_prompt(conversation, k, answers)
        index = conversation.index * config.turns + k
        record = RequestRecord(index, len(prompt), config.max_tokens)
        turn = Turn(conversation.index, k, record, reusable_tokens(config, conversation, k))
        out.append(turn)
        async with gate:
            message = turn_request(prompt, config.max_tokens, salt)
            await stream_turn(stub, message, turn, start, config.request_timeout_s)
        if not turn.record.ok:
            return
        answers.append(turn.token_ids)


async def drive(address: str, conversations, config: Config) -> tuple[list[Turn], float]:
    turns: list[Turn] = []
    gate = asyncio.Semaphore(config.max_in_flight)
    salt = f"bench-multiturn-{uuid.uuid4().hex}"
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        start = time.perf_counter()
        await asyncio.gather(
            *(converse(stub, c, config, gate, salt, start, turns) for c in conversations)
        )
        wall = time.perf_counter() - start
    turns.sort(key=lambda t: (t.conversation, t.turn))
    return turns, wall


# -- runs ----------------------------------------------------------------------------------


def worker_flags(config: Config, offload: bool) -> list[str]:
    flags = [
        *("--num-blocks", str(config.pool_blocks), "--block-size", str(config.block_size)),
        *("--max-model-len", str(config.longest_turn)),
    ]
    return [*flags, "--kv-offload-cpu-bytes", config.offload_bytes] if offload else flags


def pool_delta(before, after) -> dict:
    out = {name: getattr(after, name) - getattr(before, name) for name in POOL_COUNTERS}
    out["num_blocks"] = after.num_blocks
    out["num_offload_cpu_blocks"] = after.num_offload_cpu_blocks
    return out


def summarize_run(turns: list[Turn], wall: float, before, after) -> dict:
    records = [t.record for t in turns]
    overall = summarize(records, wall)

    def ttfts(returning: bool) -> list[float]:
        done = [t.record for t in turns if t.record.ok and (t.turn > 0) == returning]
        return [ttft_s(r) for r in done if ttft_s(r) is not None]

    keep = ("completed", "failed", "errors", "wall_s", "prompt_tokens", "output_tokens")
    return {
        **{key: overall[key] for key in keep},
        "cached_tokens": overall["cached_tokens"],
        "reusable_tokens": sum(t.reusable_tokens for t in turns),
        "turns_reusing_less": sum(t.record.cached_tokens < t.reusable_tokens for t in turns),
        "total_tokens_per_s": overall["total_tokens_per_s"],
        "output_tokens_per_s": overall["output_tokens_per_s"],
        "ttft_returning_ms": distribution_ms(ttfts(True)),
        "ttft_first_turn_ms": distribution_ms(ttfts(False)),
        "pool": pool_delta(before, after),
        "per_turn": [t.row() for t in turns],
    }


def stack_shape(config: Config, offload: bool) -> tuple[dict, dict, int | None]:
    """(flags per role, worker counts, role of the pool that runs prompts): one `both`
    worker, or a prefill worker (the small pool, the tier) and a decode worker."""
    flags = worker_flags(config, offload)
    if config.topology == "pd":
        decode = ["--max-model-len", str(config.longest_turn)]
        return {"prefill": flags, "decode": decode}, {}, types_pb2.WORKER_ROLE_PREFILL
    return {"both": flags}, dict(prefill=0, decode=0, both=1), None


def run_mode(config: Config, model: Path, vocab, conversations, label: str, offload: bool):
    """One workload on a fresh stack: the summary and the turns."""
    extra, shape, role = stack_shape(config, offload)
    with bench_stack(model, extra, f"bench-multiturn-{label}-", **shape) as s:
        address, scheduler = s.spec.gateway_address, s.spec.scheduler_address
        warm_up(address, vocab)
        before, load = pool_stats(scheduler, role), load_average()
        turns, wall = asyncio.run(drive(address, conversations, config))
        after = pool_stats(scheduler, role)
    summary = summarize_run(turns, wall, before, after)
    summary["load_avg_1m_before"] = load
    return summary, turns


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two answers differ (None: they are equal)."""
    if list(a) == list(b):
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def answer_mismatches(off: list[Turn], on: list[Turn]) -> list[dict]:
    """Turns whose answers differ between the runs (greedy: there should be none); a turn
    missing from one run (its conversation stopped at a failure) counts as differing."""
    answers = {(t.conversation, t.turn): t.token_ids for t in off}
    answers_on = {(t.conversation, t.turn): t.token_ids for t in on}
    out = []
    for key in sorted(answers.keys() | answers_on.keys()):
        a, b = answers.get(key), answers_on.get(key)
        first = 0 if a is None or b is None else first_difference(a, b)
        if first is not None:
            out.append({"conversation": key[0], "turn": key[1] + 1, "first_differing_token": first})
    return out


def _ratio(on: float | None, off: float | None) -> float | None:
    return None if on is None or not off else round(on / off, 3)


def ratios(off: dict, on: dict) -> dict:
    """on / off: below 1 for latencies and computed tokens is the tier helping."""
    ttft = {q: _ratio(on["ttft_returning_ms"][q], off["ttft_returning_ms"][q])
            for q in ("mean", "p50", "p90")}  # fmt: skip
    return {
        "ttft_returning": ttft,
        "total_tokens_per_s": _ratio(on["total_tokens_per_s"], off["total_tokens_per_s"]),
        "prompt_tokens_computed": _ratio(
            on["pool"]["prompt_tokens_computed"], off["pool"]["prompt_tokens_computed"]
        ),
    }


def run_workload(config: Config, model: Path, vocab, workload: str) -> dict:
    conversations = build_conversations(config, vocab, workload)
    runs, turns = {}, {}
    for label, offload in MODES:
        print(f"{workload}: {label} ...", file=sys.stderr, flush=True)
        runs[label], turns[label] = run_mode(config, model, vocab, conversations, label, offload)
    mismatches = answer_mismatches(turns["offload_off"], turns["offload_on"])
    return {
        "runs": runs,
        "ratios_on_over_off": ratios(runs["offload_off"], runs["offload_on"]),
        "answers_compared": len(turns["offload_off"]),
        "answer_mismatches": mismatches,
    }


# -- report --------------------------------------------------------------------------------


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


ROWS = (
    ("TTFT turns>=2 mean ms", lambda r: r["ttft_returning_ms"]["mean"]),
    ("TTFT turns>=2 p50 ms", lambda r: r["ttft_returning_ms"]["p50"]),
    ("TTFT turns>=2 p90 ms", lambda r: r["ttft_returning_ms"]["p90"]),
    ("TTFT turn 1 p50 ms", lambda r: r["ttft_first_turn_ms"]["p50"]),
    ("total tokens/s", lambda r: r["total_tokens_per_s"]),
    ("prompt tokens", lambda r: r["prompt_tokens"]),
    ("  reusable (earlier turns)", lambda r: r["reusable_tokens"]),
    ("prompt tokens computed", lambda r: r["pool"]["prompt_tokens_computed"]),
    ("  from device cache", lambda r: r["pool"]["prefix_hit_tokens"]),
    ("  from offload tier", lambda r: r["pool"]["offload_hit_tokens"]),
    ("tier blocks saved", lambda r: r["pool"]["offload_saved_blocks"]),
    ("turns reusing less", lambda r: r["turns_reusing_less"]),
    ("device evictions", lambda r: r["pool"]["evictions"]),
    ("failed turns", lambda r: r["failed"]),
)


def format_table(name: str, result: dict) -> str:
    off, on = result["runs"]["offload_off"], result["runs"]["offload_on"]
    width = max(len(row) for row, _ in ROWS)
    lines = [f"{name}", f"{'':{width}}  {'offload off':>12}  {'offload on':>12}  {'on/off':>7}"]
    for row, get in ROWS:
        a, b = get(off), get(on)
        ratio = _ratio(b, a) if isinstance(a, int | float) and isinstance(b, int | float) else None
        lines.append(f"{row:{width}}  {_fmt(a):>12}  {_fmt(b):>12}  {_fmt(ratio, 3):>7}")
    bad = result["answer_mismatches"]
    verdict = f"DIFFER in {len(bad)}: {bad}" if bad else "identical"
    lines.append(f"answers ({result['answers_compared']} turns, off vs on): {verdict}")
    return "\n".join(lines)


def headline(config: Config) -> str:
    return (
        f"{config.conversations} conversations x {config.turns} turns, "
        f"{config.max_in_flight} in flight, topology {config.topology}; "
        f"device pool {config.pool_blocks} blocks of "
        f"{config.block_size}, working set {config.working_set_blocks} blocks "
        f"({config.working_set_blocks / config.pool_blocks:.1f}x the pool)"
    )


# -- the benchmark -------------------------------------------------------------------------


def resolve_model(name: str) -> Path:
    return bench_model(name) if name in BENCH_MODELS else Path(name)


def run_benchmark(config: Config) -> dict:
    """Every workload of `config`, each offload off then on; writes and returns the report."""
    model = resolve_model(config.model)
    vocab = usable_token_ids(AutoTokenizer.from_pretrained(model))
    started = time.perf_counter()
    results = {w: run_workload(config, model, vocab, w) for w in config.workloads}
    report = {
        "benchmark": "multiturn",
        "config": {**asdict(config), "model_path": str(model)},
        "pool_blocks": config.pool_blocks,
        "working_set_blocks": config.working_set_blocks,
        "prompt_lens": [config.prompt_len(t) for t in range(config.turns)],
        "workloads": results,
        "machine": machine_info(),
        "wall_s": round(time.perf_counter() - started, 1),
        "notes": [
            "A fresh stack per run (topology in config); greedy, EOS ignored, token-id "
            "prompts over gRPC; one warm-up pair of requests per stack, not measured.",
            "reusable_tokens: the full blocks of a turn's prompt that earlier turns computed "
            "(the previous prompt and answer but its last token; on a first turn the system "
            "prompt); turns_reusing_less: turns whose cached_tokens fell short of it.",
            "Pool counters are the pool's GetPoolStats after the run minus before it: "
            "prefix_hit_tokens = prompt tokens served by the device prefix cache, "
            "offload_hit_tokens = loaded from the host tier, prompt_tokens_computed = the rest.",
            "TTFT counts from the turn's send, after it got a slot among those in flight.",
        ],
    }
    report["json_path"] = str(write_report(config.out, report))
    return report


def parse_args(argv: Sequence[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(
        prog="python -m bench.multiturn",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default="llama-32m", help=f"{', '.join(BENCH_MODELS)} or a model folder")
    add("--workload", default="all", choices=("all", *WORKLOADS))
    add("--conversations", type=int, default=8)
    add("--turns", type=int, default=4)
    add("--system-len", type=int, default=64, help="tokens of the shared system prompt")
    add("--user-len", type=int, default=64, help="tokens of each user message")
    add("--max-tokens", type=int, default=32, help="tokens of each answer")
    add("--max-in-flight", type=int, default=2, help="turns running at once")
    add("--topology", default="both", choices=TOPOLOGIES, help="pd: prefill + decode worker")
    add("--block-size", type=int, default=16)
    add("--num-blocks", type=int, default=0, help="device pool (0: the turns in flight + 4)")
    add("--kv-offload-cpu-bytes", default="512MiB", help="the tier of the offload-on runs")
    add("--seed", type=int, default=0)
    add("--request-timeout", type=float, default=300.0, help="seconds per turn")
    add("--out", default=str(RESULTS / "multiturn_offload_cpu.json"))
    args = parser.parse_args(argv)
    try:
        return Config(
            model=args.model,
            workloads=WORKLOADS if args.workload == "all" else (args.workload,),
            conversations=args.conversations,
            turns=args.turns,
            system_len=args.system_len,
            user_len=args.user_len,
            max_tokens=args.max_tokens,
            max_in_flight=args.max_in_flight,
            topology=args.topology,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            offload_bytes=args.kv_offload_cpu_bytes,
            seed=args.seed,
            request_timeout_s=args.request_timeout,
            out=args.out,
        )
    except ValueError as error:
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    report = run_benchmark(config)
    print(headline(config))
    for name, result in report["workloads"].items():
        print()
        print(format_table(name, result))
    print(f"\nbenchmark took {report['wall_s']:.0f}s; wrote {report['json_path']}")
    results = report["workloads"].values()
    if any(r["answer_mismatches"] or any(m["failed"] for m in r["runs"].values()) for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
