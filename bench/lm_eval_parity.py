"""lm-eval's loglikelihoods through Tandem equal its own `transformers` backend's.

Runs the real `lm-eval` package (installed on first use into its own virtualenv under
`.tandem/lm-eval/`, beside `transformers` and the CPU torch) twice on one multiple-choice
task defined in local files: `--model local-completions` against a Tandem stack's HTTP
front (`echo` + `logprobs`, the way evaluation harnesses score), and `--model hf` on the
same model folder in float32. Compares every (document, choice) loglikelihood and the
task's accuracy, and writes `bench/results/lm_eval_parity.json`.

    python -m bench.lm_eval_parity [--model FOLDER] [--docs 40]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.peer_servers import tandem_server

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
VENV = ROOT / ".tandem" / "lm-eval" / "venv"
LM_EVAL = "lm-eval[api,hf]==0.4.13"
PINS = ("torch==2.13.0", "transformers==5.23.0", "tokenizers==0.23.3")
TOLERANCE = 1e-4
TASK = "tandem_mc"
WORDS = (
    "river mountain bread window silver garden music winter candle forest engine paper "
    "harbor lantern meadow copper violin orchard thunder marble"
).split()


def ensure_lm_eval() -> Path:
    """The virtualenv's `lm_eval` command, installing it on first use."""
    command, stamp = VENV / "bin" / "lm_eval", VENV / "installed.txt"
    wanted = " ".join((LM_EVAL, *PINS))
    if command.exists() and stamp.exists() and stamp.read_text() == wanted:
        return command
    VENV.parent.mkdir(parents=True, exist_ok=True)
    if not VENV.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, PINS[0]], check=True)  # the CPU wheel first: no CUDA torch
    subprocess.run([*pip, LM_EVAL, *PINS[1:]], check=True)
    stamp.write_text(wanted)
    return command


def write_task(folder: Path, docs: int) -> None:
    """A 4-way multiple-choice task over made-up sentences, as local JSON lines."""
    rng = random.Random(0)
    with open(folder / "docs.jsonl", "w") as out:
        for _ in range(docs):
            words = rng.sample(WORDS, 6)
            out.write(
                json.dumps(
                    {
                        "question": f"The {words[0]} and the {words[1]} are near the",
                        "choices": [f" {w}" for w in words[2:6]],
                        "answer": rng.randrange(4),
                    }
                )
                + "\n"
            )
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )


def run_lm_eval(command: Path, model: str, model_args: str, task_dir: Path, out: Path) -> dict:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    subprocess.run(
        [str(command), "--model", model, "--model_args", model_args, "--tasks", TASK,
         "--include_path", str(task_dir), "--output_path", str(out), "--log_samples",
         "--batch_size", "8"],
        check=True, env=env,
    )  # fmt: skip
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    (results,) = out.rglob("results_*.json")
    scores = {}
    for line in samples.read_text().splitlines():
        doc = json.loads(line)
        for i, response in enumerate(doc["resps"]):
            scores[(doc["doc_id"], i)] = float(response[0][0])
    acc = json.loads(results.read_text())["results"][TASK]["acc,none"]
    return {"scores": scores, "acc": acc}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / ".tandem" / "models" / "tandem-tiny-llama"))
    parser.add_argument("--docs", type=int, default=40)
    parser.add_argument("--out", default=str(RESULTS / "lm_eval_parity.json"))
    args = parser.parse_args(argv)
    model = str(Path(args.model).resolve())
    if not Path(model, "config.json").exists():
        from devtools.checkpoint_builder import build_default_model

        model = str(build_default_model(Path(model)))
    command = ensure_lm_eval()
    work = Path(tempfile.mkdtemp(prefix="lm-eval-parity-"))
    write_task(work, args.docs)
    with tandem_server(model, both=False) as base_url:
        tandem = run_lm_eval(
            command,
            "local-completions",
            f"model={Path(model).name},base_url={base_url}/v1/completions,tokenizer={model},"
            "tokenized_requests=True,num_concurrent=4,max_retries=1",
            work,
            work / "tandem",
        )
    hf = run_lm_eval(command, "hf", f"pretrained={model},dtype=float32", work, work / "hf")
    keys = sorted(hf["scores"])
    assert keys == sorted(tandem["scores"]), "the two runs scored different requests"
    diffs = [abs(tandem["scores"][k] - hf["scores"][k]) for k in keys]
    report = {
        "benchmark": "lm_eval_parity",
        "lm_eval": LM_EVAL,
        "model": Path(model).name,
        "task": f"{TASK}: {args.docs} documents x 4 choices, multiple_choice (loglikelihood)",
        "requests": len(keys),
        "max_abs_loglikelihood_diff": max(diffs),
        "mean_abs_loglikelihood_diff": sum(diffs) / len(diffs),
        "tolerance": TOLERANCE,
        "within_tolerance": max(diffs) <= TOLERANCE,
        "acc_tandem_local_completions": tandem["acc"],
        "acc_hf": hf["acc"],
        "first_scores": [
            {"doc": k[0], "choice": k[1], "tandem": tandem["scores"][k], "hf": hf["scores"][k]}
            for k in keys[:8]
        ],
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "first_scores"}, indent=2))
    if not report["within_tolerance"]:
        sys.exit(f"loglikelihoods differ by up to {max(diffs):.2e} (> {TOLERANCE})")


if __name__ == "__main__":
    main()
