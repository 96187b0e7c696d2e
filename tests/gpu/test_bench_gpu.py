"""The one-call GPU benchmark must not rot while no GPU is around: its smoke mode runs every
section on tiny shapes on CPU (Triton kernels in the interpreter) and writes the report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a GPU machine runs the full benchmark (the interpreter is for machines without one)",
)
def test_gpu_benchmark_smoke_run_covers_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["copy_gbps_read_plus_write"] > 0
    decode = report["kernels"]["decode"]
    assert [(r["batch"], r["context"]) for r in decode] == [(1, 32), (2, 32)]
    assert all(r["max_abs_error_vs_reference"] < 1e-3 and r["kernel_us"] > 0 for r in decode)
    assert report["kernels"]["prefill"]["ms"] > 0
    assert [r["batch"] for r in report["decode_step"]] == [1, 2]
    assert all(r["eager_ms"] > 0 for r in report["decode_step"])
    throughput = report["throughput"]
    assert throughput["tandem_tokens_per_s"] > 0 and throughput["hf_generate_tokens_per_s"] > 0
    # fp32 on CPU: our runner and HF generate agree on every greedy token.
    assert throughput["greedy_tokens_agreeing_before_first_difference_mean"] == 8


def test_gpu_benchmark_refuses_a_full_run_without_cuda():
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    if result.returncode == 0:  # a CUDA machine runs the real thing; nothing to check here
        return
    assert "no CUDA device" in result.stderr
