"""The multi-turn offload benchmark (`bench/multiturn.py`): its workload and comparisons as
pure functions, and one small run of it (offload off and on) on the tiny test checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.metrics import RequestRecord
from bench.multiturn import (
    Config,
    Turn,
    answer_mismatches,
    build_conversations,
    format_table,
    parse_args,
    reusable_tokens,
    run_benchmark,
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


def test_reusable_tokens_and_the_automatic_pool():
    config = Config(system_len=40, user_len=16, max_tokens=8, turns=3, max_in_flight=2)
    (conversation, *_) = build_conversations(config, VOCAB, "multiturn")
    # first turn: the system prompt's full blocks; later: the previous prompt and answer
    # without its last token (never fed back), in full blocks
    assert reusable_tokens(config, conversation, 0) == 32
    assert reusable_tokens(config, conversation, 1) == (56 + 8 - 1) // 16 * 16 == 48
    assert config.longest_turn == 40 + 3 * 16 + 2 * 8 + 8 == 112
    assert config.pool_blocks == 2 * 7 + 4
    assert Config(num_blocks=9).pool_blocks == 9
    with pytest.raises(ValueError):
        Config(workloads=("bogus",))


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


def test_cli():
    config = parse_args(["--workload", "unique", "--conversations", "3", "--topology", "pd"])
    assert (config.workloads, config.conversations, config.topology) == (("unique",), 3, "pd")
    assert parse_args([]).workloads == ("multiturn", "unique")


def test_multiturn_benchmark_end_to_end(tiny_llama_dir: Path, tmp_path: Path):
    """Three conversations of two turns, one turn at a time, a pool of one turn: each
    conversation's second turn finds its history evicted from the device, and with the
    tier on loads it from there; the answers are the same either way."""
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
        offload_bytes="4MiB",
        request_timeout_s=60,
        out=str(out),
    )
    report = run_benchmark(config)
    result = json.loads(out.read_text())["workloads"]["multiturn"]
    off, on = result["runs"]["offload_off"], result["runs"]["offload_on"]
    assert (off["completed"], on["completed"], off["failed"], on["failed"]) == (6, 6, 0, 0)
    assert result["answer_mismatches"] == [] and result["answers_compared"] == 6
    assert off["pool"]["offload_hit_tokens"] == 0 and on["pool"]["offload_hit_tokens"] > 0
    assert on["pool"]["prompt_tokens_computed"] < off["pool"]["prompt_tokens_computed"]
    assert on["pool"]["offload_saved_blocks"] > 0 and on["ttft_returning_ms"]["count"] == 3
    assert len(on["per_turn"]) == 6
    assert "from offload tier" in format_table("multiturn", report["workloads"]["multiturn"])
