"""Speculative decoding on answers that copy from their prompt: SmolLM2's chat prompts built
from the held-out text's paragraphs (repeat it, fix its typos, pull its names and dates out
as JSON, summarise it), greedy, through the default stack shape (1 prefill + 1 decode
worker). Modes: off, n-gram, and the target's own first N layers as the draft model
(`num_draft_layers`); c1 and c16; each mode on a fresh stack, the modes alternated per
round (`bench.load_runs`, as `bench.spec_decode` runs them).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from bench import spec_decode
from bench.quality_ppl import paragraphs
from bench.workloads import BenchRequest

LOADS = ((1, 8), (16, 32))  # (concurrency, requests)
MAX_TOKENS = 160
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip
DRAFT_LAYERS = 15  # of SmolLM2's 30


def draft_config(model: Path, layers: int = DRAFT_LAYERS) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": 4,
            "num_draft_layers": layers}  # fmt: skip


def typos(text: str) -> str:
    """Every 6th word, if it has 5+ letters, with its two middle letters swapped."""
    count = 0

    def swap(match: re.Match) -> str:
        nonlocal count
        word = match.group(0)
        count += 1
        if len(word) < 5 or count % 6:
            return word
        i = len(word) // 2
        return word[: i - 1] + word[i] + word[i - 1] + word[i + 1 :]

    return re.sub(r"[A-Za-z]+", swap, text)


TASKS = {
    "repeat": lambda p: f"Repeat the following paragraph exactly, word for word:\n\n{p}",
    "fix_typos": lambda p: (
        "The paragraph below has some spelling mistakes. Rewrite the whole paragraph with "
        f"the mistakes corrected and nothing else changed.\n\n{typos(p)}"
    ),
    "extract": lambda p: (
        "List every person's name, place and date mentioned in this text as JSON with the "
        f'keys "names", "places" and "dates". Copy them exactly as written.\n\n{p}'
    ),
    "summarise": lambda p: f"Summarise this paragraph in two or three sentences:\n\n{p}",
}


def copy_prompts(count: int) -> list[tuple[str, str]]:
    """(task, user message) pairs: body paragraphs in order, tasks in turn."""
    body = [p for p in paragraphs() if len(p.split()) > 30]
    kinds = list(TASKS)
    return [
        (kinds[i % len(kinds)], TASKS[kinds[i % len(kinds)]](body[i % len(body)]))
        for i in range(count)
    ]


def chat_ids(tokenizer, message: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip


def workloads(tokenizer) -> list[list[BenchRequest]]:
    out = []
    for _, n in LOADS:
        prompts = copy_prompts(n)
        out.append(
            [
                BenchRequest(i, tuple(chat_ids(tokenizer, m)), MAX_TOKENS)
                for i, (_, m) in enumerate(prompts)
            ]  # fmt: skip
        )
    return out


def run_mode(model: Path, speculative: dict | None, requests_by_load, label: str) -> dict:
    # 4096 tokens of context: a draft's pool shares the worker's KV memory (its blocks
    # beside the target's), which then no longer holds SmolLM2's 8192.
    context = ["--max-model-len", "4096"]
    config = json.dumps(speculative) if speculative else ""
    return spec_decode.run_mode(
        model, config, requests_by_load, "greedy", LOADS,
        {"prefill": context, "decode": context}, f"quality-{label}",
    )  # fmt: skip


def speculation(model: Path, tokenizer, rounds: int = 1) -> dict:
    """Every mode `rounds` times, alternated; ratios off / on per round."""
    by_load = workloads(tokenizer)
    configs = {"off": None, "ngram": NGRAM, "draft_layers": draft_config(model)}
    runs: dict[str, list[dict]] = {m: [] for m in configs}
    for r in range(rounds):
        for mode, config in configs.items():
            row = run_mode(model, config, by_load, f"{mode}-r{r}")
            runs[mode].append(row)
            print(f"spec {mode} r{r}:", json.dumps({k: {"tpot_p50": v["tpot_ms"]["p50"],
                  "tok_s": v["output_tokens_per_s"], "acceptance": v.get("acceptance_rate")}
                  for k, v in row.items()}), flush=True)  # fmt: skip
    summary = spec_decode.off_vs_on(runs, LOADS)
    return {
        "configs": configs,
        "loads": [{"concurrency": c, "requests": n} for c, n in LOADS],
        "max_tokens": MAX_TOKENS,
        "tasks": list(TASKS),
        "runs": runs,
        "summary": summary,
        "median_c1_speedup": {
            m: statistics.median(s["c1"]["tpot_p50_off_over_on"]) for m, s in summary.items()
        },
    }
