"""The fp8 KV cache through the real services: a prefill and a decode worker with
`--kv-cache-dtype fp8` describe one-byte KV entries (a quarter of float32's block bytes, so
the transfers move fp8 bytes), serve a concurrent workload with shared prefixes, chunked
prefill and swap preemption on small pools, agree with HF's float32 greedy tokens on a
briefly trained tiny Llama, and end leak-free."""

from __future__ import annotations

import grpc

from common.model_config import ModelConfig
from common.pb.tandem.internal.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.service.test_e2e import run_concurrently
from tests.service.test_e2e_scheduling import SMALL_POOLS, workload
from tests.stack_client import start_stack, wait_until_idle

FP8 = ["--kv-cache-dtype", "fp8"]


def test_fp8_kv_serves_close_to_hf_and_leak_free(trained_llama_dir, tmp_path):
    args = {
        "prefill": [*SMALL_POOLS["prefill"], *FP8],
        "decode": [*SMALL_POOLS["decode"], *FP8],
        "scheduler": [*SMALL_POOLS["scheduler"], "--preemption-mode", "swap"],
    }
    stack = start_stack(trained_llama_dir, tmp_path / "run", prefill=1, decode=1, extra_args=args)
    try:
        config = ModelConfig.from_folder(trained_llama_dir)
        fp32_block = 2 * config.num_hidden_layers * 16 * config.num_key_value_heads * 4
        for process in stack.processes:
            if not process.name.startswith(("prefill-", "decode-")):
                continue
            stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(process.address))
            described = stub.DescribeWorker(worker_pb2.DescribeWorkerRequest(), timeout=10)
            assert described.model.dtype == "float8_e4m3fn"
            assert described.kv_cache.block_bytes * 4 == fp32_block * config.head_dim
        work = workload(hf_tokenizer(str(trained_llama_dir)))
        # Queued together (`held`): their KV outgrows the decode pool (`workload`).
        results = run_concurrently(stack.spec.gateway_address, work, held=stack)
        pairs = []
        for (prompt, max_tokens), got in zip(work, results, strict=True):
            assert len(got.token_ids) == max_tokens
            reference = hf_greedy(trained_llama_dir, prompt, max_tokens)
            # Free-running: after a first difference the two continue different texts.
            same = [a == b for a, b in zip(got.token_ids, reference, strict=True)]
            first_miss = same.index(False) if False in same else max_tokens
            pairs.append((first_miss, max_tokens))
        matched = sum(m for m, _ in pairs) / sum(n for _, n in pairs)
        assert matched >= 0.8, pairs
        stats = wait_until_idle(stack)
        (decoding,) = [p for p in stats.pools if p.role == types_pb2.WORKER_ROLE_DECODE]
        assert decoding.kv_transfers > 0 and decoding.swap_outs > 0
        assert decoding.num_free_swap_blocks == decoding.num_swap_blocks
        assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)
    finally:
        stack.stop()
