"""A draft model's checks at worker start, one line each naming the problem: no checkpoint
there, a different vocabulary (another tokenizer), more draft layers than the checkpoint
has, and too few positions for the target's max_model_len; and a worker process given such
a draft exits at start with that one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from common.model_config import ModelConfig
from common.speculative_config import SpeculativeConfig
from services.worker.models.attention_backend import select_backend
from services.worker.spec_decode.draft_loader import load_draft


def spec(model, **extra) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="draft_model", num_speculative_tokens=2, model=str(model), **extra
    )


def load(spec_, target_dir, max_model_len=64):
    target = ModelConfig.from_folder(target_dir)
    cpu = torch.device("cpu")
    return load_draft(spec_, target, max_model_len, torch.float32, cpu, select_backend("auto", cpu))


def test_a_good_draft_loads_truncated(tiny_llama_dir):
    draft = load(spec(tiny_llama_dir, num_draft_layers=1), tiny_llama_dir)
    assert draft.config.num_hidden_layers == 1
    assert draft.block_bytes(16) * ModelConfig.from_folder(tiny_llama_dir).num_hidden_layers == (
        load(spec(tiny_llama_dir), tiny_llama_dir).block_bytes(16)
    )
    assert load(None, tiny_llama_dir) is None


@pytest.mark.parametrize(
    ("make_spec", "max_model_len", "expected"),
    [
        (lambda d, q: spec(d / "absent"), 64, "is not a checkpoint folder (no config.json)"),
        (lambda d, q: spec(q), 64, "the draft model's vocab_size"),
        (lambda d, q: spec(d, num_draft_layers=99), 64, "num_draft_layers 99 is more than"),
        (lambda d, q: spec(d), 10**6, "below the target's max_model_len 1000000"),
    ],
    ids=["absent", "other-vocab", "too-many-layers", "too-few-positions"],
)
def test_a_bad_draft_fails_with_one_line(
    tiny_llama_dir, tiny_qwen2_dir, make_spec, max_model_len, expected
):
    with pytest.raises(ValueError) as caught:
        load(make_spec(tiny_llama_dir, tiny_qwen2_dir), tiny_llama_dir, max_model_len)
    message = str(caught.value)
    assert message.startswith("--speculative-config: ") and "\n" not in message
    assert expected in message


def test_a_worker_with_a_bad_draft_exits_at_start_with_the_line(tiny_llama_dir, tiny_qwen2_dir):
    config = spec(tiny_qwen2_dir).to_json()
    done = subprocess.run(
        [sys.executable, "-m", "services.worker", "--role", "decode", "--model",
         str(tiny_llama_dir), "--port", "0", "--speculative-config", config],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    lines = [x for x in done.stderr.splitlines() if "startup error" in x]
    assert len(lines) == 1, done.stderr[-2000:]
    assert "--speculative-config: the draft model's vocab_size 1088" in lines[0]
