"""gpt-oss served end to end, checked against HF `generate` (fp32 greedy): a tiny checkpoint
with its experts in MXFP4 (as the published ones; `devtools.mxfp4_checkpoint`), sliding /
full / sliding layers with a window of 12 (shorter than a KV block, the step budget and
every prompt here), attention sinks, YaRN RoPE. One disaggregated stack: a prefill worker of
two tensor-parallel ranks (attention heads and each expert's inner dimension split) and a
decode worker of two ranks with expert parallelism (attention heads split, two of the four
experts whole on each rank), all dequantized from MXFP4 at load, under a 16-token step
budget, so prompts are prefilled in chunks attending to earlier chunks through the cache,
their KV moves to the decode worker, concurrent requests share steps, a repeated prompt hits
the prefix cache; every output equals HF's (HF dequantizing the same MXFP4 folder). And a
worker given a gpt-oss checkpoint with a setting Tandem does not compute exits with one line
naming it.
"""

from __future__ import annotations

import shutil

import pytest

from devtools.checkpoint_builder import build_checkpoint
from devtools.mxfp4_checkpoint import quantize_checkpoint_experts
from tests.service.architecture_checks import (
    chunked_prompts_equal_hf,
    repeated_prompt_hits_the_prefix_cache,
    startup_error_lines,
)
from tests.service.test_e2e_tensor_parallel import peer_ranks

WINDOW = 12
BUDGET = 16  # prompt tokens per step
DECODE = 2  # WorkerRole
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "truncate": False,
}


def mxfp4_checkpoint(tmp_path_factory):
    """The tiny gpt-oss checkpoint with MXFP4 experts (module docstring)."""
    plain = build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "gpt-oss", "gpt_oss", num_hidden_layers=3,
        intermediate_size=64, sliding_window=WINDOW, rope_scaling=YARN, seed=43,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("ckpt") / "gpt-oss-mxfp4"
    shutil.copytree(plain, folder)
    return quantize_checkpoint_experts(folder)


@pytest.fixture(scope="module")
def served(module_stacks, tmp_path_factory):
    """(MXFP4 checkpoint folder, stack) for the whole module."""
    folder = mxfp4_checkpoint(tmp_path_factory)
    stack = module_stacks(
        folder,
        name="gpt-oss",
        extra_args={
            "scheduler": ["--max-num-batched-tokens", str(BUDGET)],
            "prefill": ["--tensor-parallel-size", "2"],
            "decode": ["--tensor-parallel-size", "2", "--enable-expert-parallel"],
        },
    )
    return folder, stack


def test_chunked_prompts_past_the_window_equal_hf(served) -> None:
    folder, stack = served
    workers = [p.name for p in stack.processes if p.name.startswith(("prefill-", "decode-"))]
    assert [len(peer_ranks(stack, w)) for w in workers] == [1, 1]  # two ranks each
    chunked_prompts_equal_hf(folder, stack)


def test_repeated_prompt_hits_the_prefix_cache(served) -> None:
    folder, stack = served
    repeated_prompt_hits_the_prefix_cache(folder, stack, "gpt-oss-repeated")


@pytest.mark.parametrize(
    "fields, line",
    [
        ({"swiglu_limit": 0}, "gpt_oss swiglu_limit must be positive, got 0"),
        (
            {"quantization_config": {"quant_method": "bitsandbytes"}},
            "quantization_config.quant_method 'bitsandbytes' is not supported: Tandem loads "
            "compressed-tensors (float-quantized FP8) and gptq (4 or 8 bits) checkpoints",
        ),
    ],
    ids=["swiglu-limit", "quant-method"],
)
def test_worker_exits_naming_an_unsupported_gpt_oss_setting(fields, line, tmp_path) -> None:
    """The start stops on the config, before any weight is read: one stderr line."""
    raw = {
        "model_type": "gpt_oss",
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        **fields,
    }
    lines = startup_error_lines(raw, tmp_path)
    assert lines == [f"python -m services.worker: startup error: {line}"]
