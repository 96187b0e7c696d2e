"""Gemma 3 text and Gemma 2 served end to end, checked against HF `generate` (fp32 greedy): one
disaggregated stack per architecture (a prefill worker and a decode worker of two tensor-parallel
ranks) with a 16-token step budget. Tiny checkpoints with sliding / full / sliding layers and a
window of 12 (shorter than a KV block, the step budget and every prompt here): Gemma 3 with its
local RoPE on the sliding layers and linear-scaled global RoPE on the full one, q/k norms; Gemma 2
with soft-caps small enough to bend its attention scores and logits. Prompts are prefilled in chunks
attending to earlier chunks through the cache, their KV moves to the decode worker, concurrent
requests share steps, a repeated prompt hits the prefix cache; every output equals HF's. And a
worker given a Gemma checkpoint with a feature Tandem does not compute exits with one line naming
it.
"""

from __future__ import annotations

import pytest

from common.model_config import SUPPORTED_ARCHITECTURES
from devtools.checkpoint_builder import build_checkpoint
from tests.service.architecture_checks import (
    chunked_prompts_equal_hf,
    repeated_prompt_hits_the_prefix_cache,
    startup_error_lines,
)

WINDOW = 12
BUDGET = 16  # prompt tokens per step
DECODE = 2  # WorkerRole
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
CHECKPOINTS = {
    "gemma3_text": {
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "config_overrides": {"layer_types": LAYER_TYPES},
        "seed": 31,
    },
    "gemma2": {
        "config_overrides": {
            "layer_types": LAYER_TYPES,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
            "query_pre_attn_scalar": 16,
        },
        "seed": 32,
    },
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def served(request, module_stacks, tmp_path_factory):
    """(checkpoint folder, stack): one per architecture, for the whole module."""
    folder = build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / request.param,
        request.param,
        num_hidden_layers=3,
        sliding_window=WINDOW,
        **CHECKPOINTS[request.param],
    )
    stack = module_stacks(
        folder,
        name=request.param,
        extra_args={
            "scheduler": ["--max-num-batched-tokens", str(BUDGET)],
            "decode": ["--tensor-parallel-size", "2"],  # KV moves into another layout
        },
    )
    return folder, stack


def test_chunked_prompts_past_the_window_equal_hf(served) -> None:
    folder, stack = served
    chunked_prompts_equal_hf(folder, stack)


def test_repeated_prompt_hits_the_prefix_cache(served) -> None:
    folder, stack = served
    repeated_prompt_hits_the_prefix_cache(folder, stack, "gemma-repeated")


def test_pipeline_stages_hold_their_layers_kv_groups(module_stacks, tmp_path_factory) -> None:
    """Gemma 3's three KV groups (sliding / full / sliding layers) on workers of two
    pipeline stages each: a stage's blocks hold its layers' slots only (the first stage
    layers 0 and 1, the second layer 2), the prompt streams from the prefill worker's
    stages into the decode worker's, chunked past the window, equal to HF."""
    folder = build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "gemma3-pp",
        "gemma3_text",
        num_hidden_layers=3,
        sliding_window=WINDOW,
        **CHECKPOINTS["gemma3_text"],
    )
    pp = ["--pipeline-parallel-size", "2"]
    stack = module_stacks(
        folder,
        name="gemma3-pp",
        extra_args={
            "scheduler": ["--max-num-batched-tokens", str(BUDGET)],
            "prefill": pp,
            "decode": pp,
        },
    )
    chunked_prompts_equal_hf(folder, stack)


@pytest.mark.parametrize(
    "fields, line",
    [
        (
            {"model_type": "gemma3_text", "use_bidirectional_attention": True},
            "gemma3_text with use_bidirectional_attention=true is not supported "
            "(causal attention only)",
        ),
        (
            {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
            f"unsupported model_type 'gemma3'; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        ),
    ],
    ids=["bidirectional", "multimodal"],
)
def test_worker_exits_naming_an_unsupported_gemma_feature(fields, line, tmp_path) -> None:
    """The start stops on the config, before any weight is read: one stderr line."""
    raw = {
        "model_type": "gemma3_text",
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        **fields,
    }
    lines = startup_error_lines(raw, tmp_path)
    assert lines == [f"python -m services.worker: startup error: {line}"]
