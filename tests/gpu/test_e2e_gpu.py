"""On a CUDA machine: the full stack with Triton attention, with and without decode CUDA
graphs, still produces HF's greedy tokens. Skips cleanly without a GPU (CI has none)."""

import pytest
import torch

from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.service.test_e2e import WORKLOAD, run_concurrently
from tests.stack_client import generate, start_stack, wait_until_idle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "enforce-eager"])
def test_triton_path_keeps_greedy_outputs_equal_to_hf(tiny_llama_dir, tmp_path, eager):
    worker_args = [
        "--attention-backend",
        "triton",
        "--dtype",
        "float32",
        "--gpu-memory-utilization",
        "0.2",
        "--cuda-graph-max-batch-size",
        "16",
    ]
    if eager:
        worker_args.append("--enforce-eager")
    stack = start_stack(
        tiny_llama_dir, tmp_path / "run", extra_args={"prefill": worker_args, "decode": worker_args}
    )
    try:
        tokenizer = hf_tokenizer(str(tiny_llama_dir))
        results = run_concurrently(stack.spec.gateway_address, WORKLOAD)
        for (prompt, max_tokens), got in zip(WORKLOAD, results, strict=True):
            want = hf_greedy(tiny_llama_dir, tokenizer.encode(prompt), max_tokens)
            assert got.token_ids == want, prompt
        wait_until_idle(stack)
    finally:
        stack.stop()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_on_the_triton_path_keeps_greedy_outputs_equal_to_hf(
    tiny_llama_dir, tmp_path, method
):
    """Verification rows are decode rows: the Triton decode kernel (and the decode CUDA
    graphs, when a step's rows fit a captured size) verify them; the draft runs eager."""
    import json

    from tests.service.test_e2e_spec_decode import biased

    config = {"method": method, "num_speculative_tokens": 3}
    config |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {
        "model": str(tiny_llama_dir), "num_draft_layers": 1
    }  # fmt: skip
    worker_args = ["--attention-backend", "triton", "--dtype", "float32",
                   "--gpu-memory-utilization", "0.2",
                   "--cuda-graph-max-batch-size", "16"]  # fmt: skip
    stack = start_stack(
        tiny_llama_dir,
        tmp_path / "run",
        extra_args={
            "prefill": worker_args,
            "decode": [*worker_args, "--speculative-config", json.dumps(config)],
            "scheduler": ["--speculative-slots", "all"],  # speculation forced, not measured
        },
    )
    try:
        tokenizer = hf_tokenizer(str(tiny_llama_dir))
        results = run_concurrently(stack.spec.gateway_address, WORKLOAD)
        for (prompt, max_tokens), got in zip(WORKLOAD, results, strict=True):
            want = hf_greedy(tiny_llama_dir, tokenizer.encode(prompt), max_tokens)
            assert got.token_ids == want, prompt
        request, want = biased(tiny_llama_dir, tokenizer.encode(WORKLOAD[0][0]), 24)
        got = generate(stack.spec.gateway_address, request)
        assert got.token_ids == want and got.usage.num_accepted_tokens > 0
        wait_until_idle(stack)
    finally:
        stack.stop()
