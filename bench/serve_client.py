"""Streaming gRPC clients for the serving benchmark: one asyncio loop drives every
request (Poisson arrivals or a closed loop of N in flight) and records what each message
brought and when (`RequestRecord`)."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import uuid
from collections.abc import Sequence

import grpc
from tqdm import tqdm

from bench.metrics import RequestRecord
from bench.structured_schemas import LOAD_SCHEMA
from bench.workloads import BenchRequest
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc

SAMPLING_MODES = ("greedy", "full", "repeat", "json")
# "json": greedy under bench/structured_schemas.LOAD_SCHEMA (structured output).
# "repeat" (or "repeat:N"): greedy with the request's first N (default 2) prompt tokens
# pushed up by logit_bias, so its output repeats itself (random-weight models never do on
# their own): a workload where n-gram speculation has something to find (with N = 1 every
# proposal is right: the upper bound).
REPEAT_TOKENS = 2
REPEAT_BIAS = 30.0
# "full": every per-token feature of the generation API at once (seeded by request index).
FULL_SAMPLING = {
    "temperature": 0.8,
    "top_k": 50,
    "top_p": 0.95,
    "min_p": 0.02,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.2,
    "frequency_penalty": 0.2,
}
FULL_LOGPROBS = 2
FULL_STOP = "\u2603\u2603\u2603"  # never produced: the matcher runs on every token


def make_request(
    request: BenchRequest, cache_salt: str, sampling: str = "greedy"
) -> generate_pb2.GenerateRequest:
    message = generate_pb2.GenerateRequest(max_tokens=request.max_tokens)
    message.token_ids.ids.extend(request.prompt_ids)
    if sampling == "full":
        for field, value in FULL_SAMPLING.items():
            setattr(message.sampling, field, value)
        message.sampling.seed = request.index
        message.sampling.logit_bias[request.prompt_ids[0]] = -1.0
        message.logprobs = FULL_LOGPROBS
        message.stopping.stop.append(FULL_STOP)
    else:
        message.sampling.temperature = 0.0
    if sampling.startswith("repeat"):
        count = int(sampling.partition(":")[2] or REPEAT_TOKENS)
        for token in dict.fromkeys(request.prompt_ids[:count]):
            message.sampling.logit_bias[token] = REPEAT_BIAS
    if sampling == "json":
        message.structured_output.json_schema = json.dumps(LOAD_SCHEMA)
    if cache_salt and "cache_salt" in generate_pb2.GenerateRequest.DESCRIPTOR.fields_by_name:
        message.cache_salt = cache_salt
    if request.lora_name:
        message.lora_name = request.lora_name
    return message


async def _stream_one(
    stub: generate_pb2_grpc.GenerateServiceStub,
    message: generate_pb2.GenerateRequest,
    record: RequestRecord,
    start: float,
    timeout_s: float,
) -> None:
    record.send_s = time.perf_counter() - start
    try:
        async for response in stub.Generate(message, timeout=timeout_s):
            now = time.perf_counter() - start
            if response.token_ids:
                record.message_s.append(now)
                record.message_tokens.append(len(response.token_ids))
            if response.HasField("usage"):
                record.usage_prompt_tokens = response.usage.prompt_tokens
                record.usage_completion_tokens = response.usage.completion_tokens
                record.cached_tokens = response.usage.cached_tokens
                record.draft_tokens = response.usage.num_draft_tokens
                record.accepted_tokens = response.usage.num_accepted_tokens
            if response.finish_reason:
                record.finish_reason = generate_pb2.FinishReason.Name(response.finish_reason)
        record.end_s = time.perf_counter() - start
    except grpc.aio.AioRpcError as error:
        record.error = f"{error.code().name}: {error.details()}"
    except Exception as error:  # a benchmark records failures, it does not crash
        record.error = f"{type(error).__name__}: {error}"


async def _drive(
    address: str,
    requests: Sequence[BenchRequest],
    offsets: Sequence[float] | None,
    concurrency: int | None,
    cache_salt: str,
    timeout_s: float,
    progress: tqdm | None,
    sampling: str = "greedy",
) -> tuple[list[RequestRecord], float]:
    records = [RequestRecord(r.index, len(r.prompt_ids), r.max_tokens) for r in requests]
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        start = time.perf_counter()

        async def one(i: int) -> None:
            if offsets is not None:
                await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            message = make_request(requests[i], cache_salt, sampling)
            if limit is None:
                await _stream_one(stub, message, records[i], start, timeout_s)
            else:
                async with limit:  # FIFO: requests enter in arrival order
                    await _stream_one(stub, message, records[i], start, timeout_s)
            if progress is not None:
                progress.update(1)

        await asyncio.gather(*(one(i) for i in range(len(requests))))
        wall = time.perf_counter() - start
    return records, wall


def run_client(
    address: str,
    requests: Sequence[BenchRequest],
    offsets: Sequence[float] | None,
    concurrency: int | None,
    cache_salt: str,
    timeout_s: float = 600.0,
    label: str = "",
    show_progress: bool = True,
    sampling: str = "greedy",
) -> tuple[list[RequestRecord], float]:
    """Send every request (at `offsets`, or keeping `concurrency` in flight) and record what
    came back; returns the records and the wall time from the start to the last stream end."""
    with tqdm(
        total=len(requests), desc=label, unit="req", disable=not show_progress, file=sys.stderr
    ) as bar:
        return asyncio.run(
            _drive(address, requests, offsets, concurrency, cache_salt, timeout_s, bar, sampling)
        )


def warm_up(address: str, vocab: Sequence[int], timeout_s: float = 120.0) -> None:
    """Two short concurrent requests, not measured (first KV transfer, allocator, threads)."""
    rng = random.Random("warm-up")
    requests = [BenchRequest(i, tuple(rng.choices(vocab, k=32)), 8) for i in range(2)]
    records, _ = run_client(
        address, requests, None, None, f"bench-warm-up-{uuid.uuid4().hex}", timeout_s, "", False
    )
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")


def model_info(address: str, timeout_s: float = 30.0) -> generate_pb2.GetModelInfoResponse:
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        return stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=timeout_s)
