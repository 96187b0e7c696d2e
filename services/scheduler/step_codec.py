"""Protobuf conversions of the scheduler's worker protocol: step plans out, step results,
worker descriptions and model shapes in. The only place in the scheduler that builds or
reads worker protobufs besides the gRPC client itself."""

from __future__ import annotations

from collections.abc import Sequence

from common.pb.tandem.internal.v1 import types_pb2, worker_pb2
from services.scheduler.pool_scheduler import PoolStepPlan
from services.scheduler.request import Logprob, Request
from services.scheduler.worker_types import ModelShape, StepResult, WorkerInfo

ROLE_FROM_PB = {
    types_pb2.WORKER_ROLE_PREFILL: "prefill",
    types_pb2.WORKER_ROLE_DECODE: "decode",
    types_pb2.WORKER_ROLE_BOTH: "both",
}


def logprob_from_pb(pb: types_pb2.TokenLogprob) -> Logprob:
    return Logprob(pb.token_id, pb.logprob, tuple((t.token_id, t.logprob) for t in pb.top_logprobs))


def sampling_to_pb(request: Request) -> types_pb2.SamplingParams:
    s = request.sampling
    message = types_pb2.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias=dict(s.logit_bias),
        min_tokens=s.min_tokens,
        stop_token_ids=sorted(request.stop_token_ids),
    )
    if s.seed is not None:
        message.seed = s.seed
    if s.logprobs is not None:
        message.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        message.prompt_logprobs = s.prompt_logprobs
    return message


def _copies(pairs: list[tuple[int, int]]) -> list[worker_pb2.BlockCopy]:
    return [worker_pb2.BlockCopy(src=src, dst=dst) for src, dst in pairs]


def plan_to_pb(
    step_id: int, plan: PoolStepPlan, cancelled_transfer_tags: Sequence[int] = ()
) -> worker_pb2.StepRequest:
    message = worker_pb2.StepRequest(
        step_id=step_id,
        cancelled_transfer_tags=cancelled_transfer_tags,
        finished_request_ids=plan.dropped_request_ids,
        swap_out=_copies(plan.swap_out),
        swap_in=_copies(plan.swap_in),
        block_copies=_copies(plan.block_copies),
    )
    for item in plan.scheduled:
        req = item.request
        if item.is_new:
            message.new_requests.append(
                worker_pb2.NewRequest(
                    request_id=req.request_id,
                    token_ids=req.all_token_ids,
                    block_ids=item.new_block_ids,
                    num_computed_tokens=item.num_computed_before,
                    num_scheduled_tokens=item.num_new_tokens,
                    sampling=sampling_to_pb(req),
                    num_prompt_tokens=len(req.prompt_token_ids),
                )
            )
        else:
            message.cached_requests.append(
                worker_pb2.CachedRequest(
                    request_id=req.request_id,
                    new_block_ids=[] if item.replaced_table else item.new_block_ids,
                    num_scheduled_tokens=item.num_new_tokens,
                    block_table=item.replaced_table or [],
                )
            )
    return message


def model_from_pb(pb: types_pb2.ModelDescription) -> ModelShape:
    return ModelShape(
        name=pb.name,
        architecture=pb.architecture,
        vocab_size=pb.vocab_size,
        max_model_len=pb.max_model_len,
        eos_token_ids=tuple(pb.eos_token_ids),
        dtype=pb.dtype,
        num_layers=pb.num_layers,
        num_kv_heads=pb.num_kv_heads,
        head_dim=pb.head_dim,
    )


def model_to_pb(model: ModelShape) -> types_pb2.ModelDescription:
    return types_pb2.ModelDescription(
        name=model.name,
        architecture=model.architecture,
        vocab_size=model.vocab_size,
        max_model_len=model.max_model_len,
        eos_token_ids=list(model.eos_token_ids),
        dtype=model.dtype,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
    )


def worker_info_from_pb(address: str, d: worker_pb2.DescribeWorkerResponse) -> WorkerInfo:
    return WorkerInfo(
        worker_id=d.worker_id,
        address=address,
        role=ROLE_FROM_PB[d.role],
        model=model_from_pb(d.model),
        num_blocks=d.kv_cache.num_blocks,
        block_size=d.kv_cache.block_size,
        block_bytes=d.kv_cache.block_bytes,
        ucx_address=d.ucx_address,
        num_swap_blocks=d.kv_cache.num_swap_blocks,
    )


def step_result_from_pb(response: worker_pb2.StepResponse) -> StepResult:
    return StepResult(
        step_id=response.step_id,
        sampled={t.request_id: t.token_id for t in response.sampled_tokens},
        execute_seconds=response.execute_seconds,
        logprobs={
            t.request_id: logprob_from_pb(t.logprob)
            for t in response.sampled_tokens
            if t.HasField("logprob")
        },
        prompt_logprobs={
            p.request_id: (p.start, [logprob_from_pb(e) for e in p.entries])
            for p in response.prompt_logprobs
        },
    )
