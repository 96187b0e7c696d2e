"""End to end through the four real services (gateway, scheduler, prefill worker, decode
worker as separate processes on free loopback ports), checked against HF `generate`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from services.stack.launcher import Stack
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.stack_client import (
    generate,
    generate_together,
    greedy_request,
    log_lines_since,
    log_size,
    pool_stats,
    start_stack,
    wait_until_idle,
)

ROOT = Path(__file__).resolve().parents[2]

# (prompt, max_tokens): short and long prompts, outputs that cross 16-token blocks.
WORKLOAD = [
    ("Once upon a time", 24),
    ("The scheduler", 1),
    (
        "KV blocks move between workers over UCX while the decode worker keeps generating "
        "tokens for everyone else in its batch.",
        40,
    ),
    ("naïve café 中文字符 🚀", 17),
    ("In the beginning", 33),
    ("a", 5),
    (
        "Paged attention stores keys and values in fixed-size blocks, and a block table maps "
        "each sequence's logical positions to physical blocks anywhere in the pool, so memory "
        "is allocated on demand and shared prefixes can be reused.",
        20,
    ),
    ("Continuous batching", 64),
    ("Greedy decoding must equal transformers token for token.", 12),
    ("Ελληνικά και русский", 48),
]


@pytest.fixture(scope="module")
def stack(api_stack):
    """The session's shared disaggregated stack (its HTTP front is no gRPC service)."""
    return api_stack


def expected(model_dir: Path, prompt: str | list[int], max_tokens: int) -> tuple[list[int], str]:
    tokenizer = hf_tokenizer(str(model_dir))
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    ids = hf_greedy(model_dir, prompt_ids, max_tokens)
    return ids, tokenizer.decode(ids, skip_special_tokens=True)


def run_concurrently(address: str, workload, held: Stack | None = None) -> list:
    """Greedy requests for every (prompt, max_tokens) at once. `held`: the stack behind
    `address`, whose scheduler then queues them all before any prompt step runs
    (`held_together`), however loaded the box: for tests that need them to overlap."""
    if held is not None:
        return generate_together(held, [greedy_request(p, n) for p, n in workload])
    barrier = threading.Barrier(len(workload))

    def one(item):
        prompt, max_tokens = item
        barrier.wait()  # all streams start together and share steps
        return generate(address, greedy_request(prompt, max_tokens))

    with ThreadPoolExecutor(len(workload)) as pool:
        return list(pool.map(one, workload))


def test_concurrent_streams_equal_hf_greedy_and_pools_return_to_baseline(stack, tiny_llama_dir):
    baseline = pool_stats(stack)
    assert {p.num_free_blocks for p in baseline.pools} == {p.num_blocks for p in baseline.pools}
    results = run_concurrently(stack.spec.gateway_address, WORKLOAD)
    eos = hf_tokenizer(str(tiny_llama_dir)).eos_token_id
    for (prompt, max_tokens), got in zip(WORKLOAD, results, strict=True):
        want_ids, want_text = expected(tiny_llama_dir, prompt, max_tokens)
        assert got.token_ids == want_ids, prompt
        assert got.text == want_text, prompt
        stopped = bool(want_ids) and want_ids[-1] == eos
        assert got.finish_reason == (
            generate_pb2.FINISH_REASON_STOP if stopped else generate_pb2.FINISH_REASON_LENGTH
        )
        assert got.usage.completion_tokens == len(want_ids)
        assert got.usage.prompt_tokens == len(hf_tokenizer(str(tiny_llama_dir)).encode(prompt))
        assert got.messages >= 1
    after = wait_until_idle(stack)
    assert [(p.worker_id, p.num_free_blocks) for p in after.pools] == [
        (p.worker_id, p.num_free_blocks) for p in baseline.pools
    ]
    assert {p.role for p in after.pools} == {1, 2}  # a prefill and a decode pool


def test_token_id_prompts_and_long_outputs_crossing_blocks(stack, tiny_llama_dir):
    prompt = list(range(3, 40))  # 37 tokens: spans three 16-token blocks
    got = generate(stack.spec.gateway_address, greedy_request(prompt, 70))
    want_ids, want_text = expected(tiny_llama_dir, prompt, 70)
    assert got.token_ids == want_ids and got.text == want_text
    wait_until_idle(stack)


BAD_REQUESTS = [
    # (request fields, expected words in the message)
    ({}, "prompt is required"),
    ({"text": ""}, "prompt.text must not be empty"),
    ({"token_ids": {"ids": []}}, "prompt.token_ids.ids must not be empty"),
    ({"text": "hi", "max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"text": "hi", "max_tokens": -5}, "max_tokens must be >= 1, got -5"),
    ({"text": "hi", "max_tokens": 512}, "exceed the context length of 512 tokens"),
    (
        {"token_ids": {"ids": list(range(500))}, "max_tokens": 13},
        "prompt (500 tokens) + max_tokens (13) must not exceed the context length of 512",
    ),
    ({"token_ids": {"ids": [1, -1]}}, "prompt.token_ids.ids[1]=-1 is outside the vocabulary"),
    ({"token_ids": {"ids": [1, 2, 10**6]}}, "prompt.token_ids.ids[2]=1000000 is outside"),
    ({"text": "hi", "sampling": {"temperature": -1}}, "sampling.temperature must be"),
    ({"text": "hi", "sampling": {"temperature": float("nan")}}, "sampling.temperature must be"),
    ({"text": "hi", "sampling": {"top_p": 0}}, "sampling.top_p must be in (0, 1]"),
    ({"text": "hi", "sampling": {"top_k": -2}}, "sampling.top_k must be >= -1"),
]


def test_bad_input_is_invalid_argument_naming_the_field_and_service_keeps_serving(
    stack, tiny_llama_dir
):
    vocab = hf_tokenizer(str(tiny_llama_dir))
    with grpc.insecure_channel(stack.spec.gateway_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
        assert info.max_model_len == 512 and info.vocab_size >= len(vocab)
        for fields, message in BAD_REQUESTS:
            request = generate_pb2.GenerateRequest()
            for key, value in fields.items():
                if isinstance(value, dict):
                    for k, v in value.items():
                        target = getattr(request, key)
                        if isinstance(v, list):
                            getattr(target, k).extend(v)
                        else:
                            setattr(target, k, v)
                    if not value:
                        getattr(request, key).SetInParent()
                else:
                    setattr(request, key, value)
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(request, timeout=30))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
            assert message in caught.value.details(), (fields, caught.value.details())
    # Still serving, with exact outputs.
    got = generate(stack.spec.gateway_address, greedy_request("Once upon a time", 8))
    assert got.token_ids == expected(tiny_llama_dir, "Once upon a time", 8)[0]
    wait_until_idle(stack)


def test_client_cancel_mid_stream_frees_every_block(stack):
    with grpc.insecure_channel(stack.spec.gateway_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        call = stub.Generate(greedy_request("Continuous batching", 400), timeout=60)
        first = next(call)
        assert first.token_ids
        call.cancel()
    wait_until_idle(stack)


def test_every_service_serves_health_and_reflection(stack):
    for process in (p for p in stack.processes if p.probe == "grpc"):
        with grpc.insecure_channel(process.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING, process.name
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert "grpc.health.v1.Health" in services
        own = {
            "gateway": "tandem.v1.GenerateService",
            "scheduler": "tandem.internal.v1.SchedulerService",
        }.get(process.name, "tandem.internal.v1.WorkerService")
        assert own in services, (process.name, services)


def test_cli_client_streams_the_completion(stack, tiny_llama_dir):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.client",
            "In the beginning",
            "--max-tokens",
            "12",
            "--address",
            stack.spec.gateway_address,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected(tiny_llama_dir, "In the beginning", 12)[1] + "\n"
    assert "12 tokens" in result.stderr


def test_both_role_worker_stops_at_eos_exactly_like_hf(tiny_llama_dir, tmp_path):
    # Make the token that greedy decoding produces 6th the checkpoint's EOS.
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    prompt = "Once upon a time"
    free_run = hf_greedy(tiny_llama_dir, tokenizer.encode(prompt), 12)
    stop_at = next(i for i in range(5, 12) if free_run[i] not in free_run[:i])
    model = tmp_path / "eos-model"
    shutil.copytree(tiny_llama_dir, model)
    gen_config = json.loads((model / "generation_config.json").read_text())
    gen_config["eos_token_id"] = free_run[stop_at]
    (model / "generation_config.json").write_text(json.dumps(gen_config))

    stack = start_stack(model, tmp_path / "run", prefill=0, decode=0, both=1)
    try:
        got = generate(stack.spec.gateway_address, greedy_request(prompt, 12))
        want = hf_greedy(model, tokenizer.encode(prompt), 12)
        assert want == free_run[: stop_at + 1]
        assert got.token_ids == want
        assert got.finish_reason == generate_pb2.FINISH_REASON_STOP
        # The stop token stays in token_ids; its text is left out (vLLM's rule), which
        # matters here because this EOS is an ordinary piece of text.
        assert got.text == tokenizer.decode(want[:-1], skip_special_tokens=True)
        stats = wait_until_idle(stack)
        assert [p.role for p in stats.pools] == [3]  # WORKER_ROLE_BOTH
    finally:
        stack.stop()


def test_small_pools_force_chunking_and_preemption_yet_outputs_equal_hf(
    tiny_llama_dir, small_pools_stack
):
    # Context 96 tokens = 6 blocks; the decode pool holds 10 blocks, so 8 concurrent
    # requests that each grow to 3-6 blocks cannot all fit: some are preempted and
    # recomputed on the prefill worker. A 24-token budget chunks every longer prompt.
    # (The session's small-pools stack: SMALL_POOLS are these flags; its log is shared,
    # so only the lines this test caused are read.)
    # Certain, not timing: the 8 are queued before the first prompt step (`held`), so all
    # reach the decode pool within the ~8 prefill steps of their 192 prompt tokens, and 7
    # of them then decode 48 tokens each, to 4-6 blocks (37 blocks in all vs 10).
    stack = small_pools_stack()
    mark = log_size(stack)
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    workload = [(p, min(48, 96 - len(tokenizer.encode(p)))) for p, _ in WORKLOAD[:8]]
    results = run_concurrently(stack.spec.gateway_address, workload, held=stack)
    for (prompt, max_tokens), got in zip(workload, results, strict=True):
        assert got.token_ids == expected(tiny_llama_dir, prompt, max_tokens)[0], prompt
    wait_until_idle(stack)
    preemptions = [
        json.loads(line).get("preemptions", 0)
        for line in log_lines_since(stack, mark)
        if '"request_finished"' in line
    ]
    assert sum(preemptions) > 0, "the small decode pool should have forced preemption"


def grpcurl(*args: str) -> str:
    binary = Path(sys.executable).parent / "grpcurl"
    result = subprocess.run(
        [str(binary), "-plaintext", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_grpcurl_lists_services_and_streams_generate_by_reflection(stack, tiny_llama_dir):
    address = stack.spec.gateway_address
    assert "tandem.v1.GenerateService" in grpcurl(address, "list").split()
    health = json.loads(grpcurl(address, "grpc.health.v1.Health/Check"))
    assert health == {"status": "SERVING"}
    # The README's command, verbatim apart from the address.
    out = grpcurl(
        "-d", '{"text": "Hello", "max_tokens": 16}', address, "tandem.v1.GenerateService/Generate"
    )
    messages = [json.loads(m) for m in out.replace("}\n{", "}\x00{").split("\x00")]
    ids = [int(t) for m in messages for t in m.get("token_ids", [])]
    # Unset temperature means 1.0 (random sampling): check shape, not tokens.
    assert len(ids) == messages[-1]["usage"]["completion_tokens"] <= 16
    assert messages[-1]["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
    greedy = grpcurl(
        "-d",
        '{"text": "Hello", "max_tokens": 16, "sampling": {"temperature": 0}}',
        address,
        "tandem.v1.GenerateService/Generate",
    )
    messages = [json.loads(m) for m in greedy.replace("}\n{", "}\x00{").split("\x00")]
    text = "".join(m.get("text", "") for m in messages)
    assert text == expected(tiny_llama_dir, "Hello", 16)[1]
