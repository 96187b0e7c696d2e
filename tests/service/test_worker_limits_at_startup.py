"""A scheduler whose settings disagree with its real workers' refuses to start, naming
both values and the flag to change (unit checks: tests/unit/test_worker_limits.py)."""

from __future__ import annotations

import pytest

from tests.stack_client import start_stack


def test_scheduler_refuses_workers_whose_kv_timeout_outlasts_its_own(tiny_llama_dir, tmp_path):
    """Real workers send their settings; the scheduler exits with one line naming both."""
    args = dict(
        extra_args={
            "scheduler": ["--kv-transfer-timeout-s", "10"],
            "prefill": ["--kv-transfer-timeout-s", "30"],
            "decode": ["--kv-transfer-timeout-s", "30"],
        },
    )
    with pytest.raises(RuntimeError, match="scheduler exited during startup") as caught:
        start_stack(tiny_llama_dir, tmp_path, **args)
    lines = [line for line in str(caught.value).splitlines() if "startup error" in line]
    assert len(lines) == 1, str(caught.value)
    line = lines[0]
    assert line.startswith("python -m services.scheduler: startup error: worker ")
    assert "kv_transfer_timeout_s=30 exceeds the scheduler's kv_transfer_timeout_s=10" in line
    assert "--kv-transfer-timeout-s 10 or less" in line
