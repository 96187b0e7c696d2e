"""DeepSeek-V3 (latent attention, grouped sigmoid router, a shared expert) through the real
services, checked against HF `generate` (fp32 greedy): a disaggregated stack of a prefill
worker and a decode worker of two tensor-parallel ranks (each holding half the heads and
the whole latent) with a 16-token step budget; the latents move through the decode
worker's shared-memory pull from a prefill worker of two expert-parallel ranks (half the
routed experts whole on each) and, in a second stack, over UCX from one rank. Both workers
describe the latent KV layout: one KV head of (kv_lora_rank + qk_rope_head_dim) / 2 values,
a block of layers x block size x (kv_lora_rank + qk_rope_head_dim) values. Prompts are prefilled in
chunks attending to earlier chunks through the cached latents, their latents move to the
decode worker's ranks (another layout), concurrent requests share steps, a repeated prompt
hits the prefix cache; every output equals HF's. Recompute and swap preemption and a
SIGKILLed decode worker as `test_e2e_architecture_paths` checks the other issue-43 models;
n-gram and first-layer-draft speculative decoding, verified over the latent cache. And a
worker given a DeepSeek checkpoint Tandem cannot serve exits with one line naming the
field.
"""

from __future__ import annotations

import grpc
import pytest

from common.model_config import ModelConfig
from common.pb.tandem.internal.v1 import worker_pb2, worker_pb2_grpc
from devtools.checkpoint_builder import build_checkpoint
from tests.hf_reference import hf_tokenizer
from tests.service import test_e2e_architecture_paths as paths
from tests.service import test_e2e_spec_decode as spec_e2e
from tests.service.architecture_checks import (
    chunked_prompts_equal_hf,
    repeated_prompt_hits_the_prefix_cache,
    startup_error_lines,
)
from tests.service.test_e2e import run_concurrently
from tests.service.test_e2e_scheduling import SMALL_POOLS, check_against_hf, workload
from tests.service.test_e2e_tensor_parallel import peer_ranks
from tests.stack_client import start_stack, wait_until_idle

BUDGET = 16  # prompt tokens per step
BLOCK = 16  # the stacks' block size
PREFILL, DECODE = 1, 2  # WorkerRole


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "deepseek_v3", "deepseek_v3",
                            seed=41)  # fmt: skip


@pytest.fixture(scope="module", params=["shm", "ucx"])
def served(request, folder, module_stacks):
    """(checkpoint folder, stack) per transport: the decode ranks copy the latents from the
    prefill worker's shared pool, or the prefill worker sends them to each rank over UCX."""
    ucx = ["--kv-transfer-shared-memory", "false"] if request.param == "ucx" else []
    stack = module_stacks(
        folder,
        name=f"deepseek_v3-{request.param}",
        extra_args={
            "scheduler": ["--max-num-batched-tokens", str(BUDGET)],
            # shm: the prefill worker expert-parallel; ucx: one rank, into another layout
            "prefill": ucx or ["--tensor-parallel-size", "2", "--enable-expert-parallel"],
            "decode": ["--tensor-parallel-size", "2", *ucx],  # into another layout
        },
    )
    decode = [p.name for p in stack.processes if p.name.startswith("decode-")]
    assert [len(peer_ranks(stack, name)) for name in decode] == [1]  # two ranks
    return folder, stack


def test_workers_describe_the_latent_kv_layout(served) -> None:
    folder, stack = served
    config = ModelConfig.from_folder(folder)
    latent = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim
    for process in stack.processes:
        if not process.name.startswith(("prefill-", "decode-")):
            continue
        with grpc.insecure_channel(process.address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            described = stub.DescribeWorker(worker_pb2.DescribeWorkerRequest(), timeout=10)
        assert (described.model.num_kv_heads, 2 * described.model.head_dim) == (1, latent)
        assert described.kv_cache.block_bytes == config.num_hidden_layers * BLOCK * latent * 4


def test_chunked_prompts_equal_hf_and_move_to_the_decode_ranks(served) -> None:
    folder, stack = served
    chunked_prompts_equal_hf(folder, stack, budget=BUDGET)


def test_repeated_prompt_hits_the_prefix_cache(served) -> None:
    folder, stack = served
    repeated_prompt_hits_the_prefix_cache(folder, stack, "deepseek-repeated")


def test_worker_exits_naming_an_unsupported_deepseek_field(tmp_path) -> None:
    """The start stops on the config, before any weight is read: one stderr line."""
    raw = {
        "model_type": "deepseek_v2",
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 128,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "topk_method": "noaux_tc",
    }
    lines = startup_error_lines(raw, tmp_path)
    assert lines == [
        "python -m services.worker: startup error: deepseek_v2 with topk_method='noaux_tc' is "
        "not supported (greedy, group_limited_greedy)"
    ]


def test_recompute_preemption_and_a_killed_decode_worker(module_stacks, folder) -> None:
    """`test_e2e_architecture_paths`' check on DeepSeek-V3: a workload that outgrows small
    pools (recomputed), then a decode worker SIGKILLed while it holds requests."""
    paths.test_recompute_preemption_and_a_killed_decode_worker(module_stacks, folder)


def test_swap_preemption(module_stacks, folder) -> None:
    """Latent blocks swapped out to the decode worker's swap space and back."""
    paths.test_swap_preemption(module_stacks, folder)


@pytest.mark.parametrize("method", ["ngram", "draft"], ids=["ngram", "first-layer-draft"])
def test_speculative_decoding_is_hf_exact(method, folder, tmp_path) -> None:
    """N-gram proposals, or DeepSeek-V3's own first layer as the draft (its own latent
    pool), verified over the latent cache: the preempting workload twice (prefix hits),
    equal to HF; proposals made and some accepted; every block back."""
    spec = spec_e2e.NGRAM if method == "ngram" else spec_e2e.draft_config(folder, 1)
    args = {
        "prefill": SMALL_POOLS["prefill"],
        "decode": [*SMALL_POOLS["decode"], "--speculative-config", spec],
        "scheduler": [*SMALL_POOLS["scheduler"], *spec_e2e.ALL_SLOTS],
    }
    stack = start_stack(folder, tmp_path / "run", extra_args=args)
    try:
        work = workload(hf_tokenizer(str(folder)))
        for _ in range(2):
            results = run_concurrently(stack.spec.gateway_address, work, held=stack)
            check_against_hf(folder, work, results)
        stats = wait_until_idle(stack)
        (decode,) = [p for p in stats.pools if p.role == DECODE]
        assert decode.spec_decode_num_draft_tokens >= decode.spec_decode_num_accepted_tokens > 0
        assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)
    finally:
        stack.stop()
