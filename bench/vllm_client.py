"""vLLM's own load generator, `vllm bench serve`, as the one client of the performance
benchmark: it drives Tandem's HTTP front and `vllm serve` the same way (OpenAI
completions, SSE streaming, random prompts, `--ignore-eos`), and its result JSON is read
back here. `dump_prompts` writes the exact prompts it sends, so HF `generate` can run on
them too.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.peer_install import peer_python

# The fields of vLLM's result JSON that the reports keep.
RESULT_KEYS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
)


@dataclass(frozen=True)
class Load:
    """One `vllm bench serve` run: random prompts of input_len tokens, output_len tokens
    each (EOS ignored), at most `concurrency` in flight."""

    concurrency: int
    num_prompts: int
    input_len: int = 128
    output_len: int = 128
    seed: int = 0


def bench_command(
    vllm: Path, base_url: str, model_name: str, tokenizer: str, load: Load, result_file: Path
) -> list[str]:
    return [
        str(vllm),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--model",
        model_name,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(load.input_len),
        "--random-output-len",
        str(load.output_len),
        "--ignore-eos",
        "--num-prompts",
        str(load.num_prompts),
        "--max-concurrency",
        str(load.concurrency),
        "--seed",
        str(load.seed),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(result_file.parent),
        "--result-filename",
        result_file.name,
    ]


def client_env() -> dict[str, str]:
    """The client process's environment: quiet, and never the accelerator's settings."""
    return {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def start_bench(
    vllm: Path, base_url: str, model_name: str, tokenizer: str, load: Load, result_file: Path
) -> subprocess.Popen:
    """Start `vllm bench serve` in the background (its output goes to result_file.log)."""
    log = open(result_file.with_suffix(".log"), "w")  # noqa: SIM115 - owned by the process
    return subprocess.Popen(
        bench_command(vllm, base_url, model_name, tokenizer, load, result_file),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=client_env(),
    )


def read_result(result_file: Path) -> dict:
    if not result_file.is_file():
        log = result_file.with_suffix(".log")
        tail = log.read_text()[-3000:] if log.is_file() else ""
        raise RuntimeError(f"vllm bench serve wrote no result {result_file}:\n{tail}")
    data = json.loads(result_file.read_text())
    out = {key: data.get(key) for key in RESULT_KEYS}
    if out["failed"]:
        raise RuntimeError(f"{out['failed']} requests failed in {result_file}")
    return out


def run_bench(
    vllm: Path, base_url: str, model_name: str, tokenizer: str, load: Load, timeout_s: float
) -> dict:
    """Run one load to the end and return its summary (RESULT_KEYS)."""
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        result = Path(tmp) / "result.json"
        process = start_bench(vllm, base_url, model_name, tokenizer, load, result)
        try:
            process.wait(timeout=timeout_s)
        finally:
            if process.poll() is None:
                process.kill()
        return read_result(result)


_DUMP = """
import json, sys
from transformers import AutoTokenizer
from vllm.benchmarks.datasets import RandomDataset
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
n, input_len, output_len, seed = (int(x) for x in sys.argv[2:6])
samples = RandomDataset(random_seed=seed).sample(
    tokenizer=tokenizer, num_requests=n, input_len=input_len, output_len=output_len
)
json.dump([s.prompt for s in samples], sys.stdout)
"""


def dump_prompts(tokenizer: str, load: Load) -> list[str]:
    """The prompts `vllm bench serve` sends for `load` (its random dataset, same seed)."""
    out = subprocess.run(
        [
            str(peer_python()),
            "-c",
            _DUMP,
            tokenizer,
            str(load.num_prompts),
            str(load.input_len),
            str(load.output_len),
            str(load.seed),
        ],
        capture_output=True,
        text=True,
        env=client_env(),
        check=True,
    )
    return json.loads(out.stdout)
