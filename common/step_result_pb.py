"""A `StepResult` as the `StepResponse` protobuf and back: what a worker's rank 0 streams to
the scheduler, and what the last pipeline stage (which samples) hands every other rank of
its worker. A request's accepted speculative proposals come before its sampled token."""

from __future__ import annotations

from common.pb.tandem.internal.v1 import worker_pb2
from common.sampling_pb import logprob_from_pb, logprob_to_pb
from common.step_result import KvLoadDone, PromptLogprobs, SpecOutcome, StepResult


def _sampled_pb(request_id: str, token: int, entry) -> worker_pb2.SampledToken:
    return worker_pb2.SampledToken(
        request_id=request_id,
        token_id=token,
        logprob=None if entry is None else logprob_to_pb(entry),
    )


def result_to_pb(result: StepResult) -> worker_pb2.StepResponse:
    sampled, spec = [], []
    for request_id, token in result.sampled.items():
        outcome = result.spec.get(request_id)
        if outcome is not None:  # accepted proposals first, in order
            for accepted, entry in zip(outcome.accepted, outcome.logprobs, strict=True):
                sampled.append(_sampled_pb(request_id, accepted, entry))
            spec.append(
                worker_pb2.SpecDecodeCounts(
                    request_id=request_id,
                    num_draft_tokens=outcome.num_draft_tokens,
                    num_accepted_tokens=outcome.num_accepted_tokens,
                )
            )
        sampled.append(_sampled_pb(request_id, token, result.logprobs.get(request_id)))
    return worker_pb2.StepResponse(
        spec_decode=spec,
        step_id=result.step_id,
        sampled_tokens=sampled,
        execute_seconds=result.execute_seconds,
        propose_seconds=result.propose_seconds,
        propose_passes=result.propose_passes,
        prompt_logprobs=[
            worker_pb2.PromptLogprobs(
                request_id=request_id,
                start=scored.start,
                entries=[logprob_to_pb(e) for e in scored.entries],
            )
            for request_id, scored in result.prompt_logprobs.items()
        ],
        draining=result.draining,
        disk_loaded=result.disk_loaded,
        disk_failed=result.disk_failed,
        disk_removed=result.disk_removed,
        offload_load_seconds=result.offload_load_seconds,
        disk_read_seconds=result.disk_read_seconds,
        kv_loads_done=[kv_load_done_pb(done) for done in result.kv_loads_done],
    )


def kv_load_done_pb(done: KvLoadDone) -> worker_pb2.KvLoadDone:
    return worker_pb2.KvLoadDone(
        transfer_tag=done.tag,
        num_bytes=done.num_bytes,
        seconds=done.seconds,
        source_lag_seconds=done.source_lag_seconds,
        error=done.error,
        pull_refused=done.pull_refused,
    )


def result_from_pb(pb: worker_pb2.StepResponse) -> StepResult:
    """The inverse of `result_to_pb`: a request's entries come in order, all but its last
    accepted proposals."""
    tokens: dict[str, list[tuple[int, object]]] = {}
    for item in pb.sampled_tokens:
        entry = logprob_from_pb(item.logprob) if item.HasField("logprob") else None
        tokens.setdefault(item.request_id, []).append((item.token_id, entry))
    sampled, logprobs, spec = {}, {}, {}
    counts = {c.request_id: c for c in pb.spec_decode}
    for request_id, items in tokens.items():
        (token, entry), accepted = items[-1], items[:-1]
        sampled[request_id] = token
        if entry is not None:
            logprobs[request_id] = entry
        count = counts.get(request_id)
        if count is not None:
            spec[request_id] = SpecOutcome(
                [t for t, _ in accepted], count.num_draft_tokens, [e for _, e in accepted]
            )
    prompt = {
        p.request_id: PromptLogprobs(p.start, tuple(logprob_from_pb(e) for e in p.entries))
        for p in pb.prompt_logprobs
    }
    return StepResult(
        step_id=pb.step_id,
        sampled=sampled,
        execute_seconds=pb.execute_seconds,
        logprobs=logprobs,
        prompt_logprobs=prompt,
        spec=spec,
        propose_seconds=pb.propose_seconds,
        propose_passes=pb.propose_passes,
        draining=pb.draining,
        disk_loaded=tuple(pb.disk_loaded),
        disk_failed=tuple(pb.disk_failed),
        disk_removed=tuple(pb.disk_removed),
        offload_load_seconds=pb.offload_load_seconds,
        disk_read_seconds=pb.disk_read_seconds,
        kv_loads_done=tuple(
            KvLoadDone(
                d.transfer_tag,
                d.num_bytes,
                d.seconds,
                d.source_lag_seconds,
                d.error,
                d.pull_refused,
            )
            for d in pb.kv_loads_done
        ),
    )
