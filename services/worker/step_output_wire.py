"""A step's results as the `StepResponse` protobuf and back: what rank 0 streams to the
scheduler, and what the last pipeline stage (which samples) hands every other rank of its
worker. Accepted speculative proposals come before the request's sampled token."""

from __future__ import annotations

from common.pb.tandem.internal.v1 import worker_pb2
from common.sampling_pb import logprob_from_pb, logprob_to_pb
from services.worker.logprobs import PromptLogprobs
from services.worker.runner import StepOutput
from services.worker.spec_decode.spec_step import SpecOutcome


def _sampled_pb(request_id: str, token: int, entry) -> worker_pb2.SampledToken:
    return worker_pb2.SampledToken(
        request_id=request_id,
        token_id=token,
        logprob=None if entry is None else logprob_to_pb(entry),
    )


def step_response_pb(step_id: int, output: StepOutput) -> worker_pb2.StepResponse:
    sampled, spec = [], []
    for request_id, token in output.sampled.items():
        outcome = output.spec.get(request_id)
        if outcome is not None:  # accepted proposals first, in order
            for accepted, entry in zip(outcome.accepted, outcome.logprobs, strict=True):
                sampled.append(_sampled_pb(request_id, accepted, entry))
            spec.append(
                worker_pb2.SpecDecodeCounts(
                    request_id=request_id,
                    num_draft_tokens=outcome.num_drafts,
                    num_accepted_tokens=len(outcome.accepted),
                )
            )
        sampled.append(_sampled_pb(request_id, token, output.logprobs.get(request_id)))
    return worker_pb2.StepResponse(
        spec_decode=spec,
        step_id=step_id,
        sampled_tokens=sampled,
        execute_seconds=output.execute_seconds,
        propose_seconds=output.propose_seconds,
        propose_passes=output.propose_passes,
        prompt_logprobs=[
            worker_pb2.PromptLogprobs(
                request_id=request_id,
                start=scored.start,
                entries=[logprob_to_pb(e) for e in scored.entries],
            )
            for request_id, scored in output.prompt_logprobs.items()
        ],
    )


def step_output_from_pb(pb: worker_pb2.StepResponse) -> StepOutput:
    """The inverse of `step_response_pb` (for the step's id, read `pb.step_id`)."""
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
    return StepOutput(
        sampled, pb.execute_seconds, logprobs, prompt, spec, pb.propose_seconds, pb.propose_passes
    )
