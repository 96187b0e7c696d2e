"""Protobuf conversions of the shared sampling types (`common/sampling.py`) and of the
worker role, each direction written once: `SamplingParams` <-> `types_pb2.SamplingParams`,
`Logprob` <-> `types_pb2.TokenLogprob`, role name <-> `types_pb2.WorkerRole`."""

from __future__ import annotations

from common.pb.tandem.internal.v1 import types_pb2
from common.sampling import Logprob, SamplingParams

ROLE_FROM_PB = {
    types_pb2.WORKER_ROLE_PREFILL: "prefill",
    types_pb2.WORKER_ROLE_DECODE: "decode",
    types_pb2.WORKER_ROLE_BOTH: "both",
}
ROLE_TO_PB = {role: pb for pb, role in ROLE_FROM_PB.items()}

_OPTIONAL_FIELDS = ("seed", "logprobs", "prompt_logprobs")  # unset on the wire = None


def sampling_to_pb(params: SamplingParams) -> types_pb2.SamplingParams:
    message = types_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens,
        stop_token_ids=params.stop_token_ids,
    )
    for name in _OPTIONAL_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(message, name, value)
    return message


def sampling_from_pb(
    pb: types_pb2.SamplingParams, seed_offset: int = 0, with_prompt_logprobs: bool = True
) -> SamplingParams:
    """The message's settings: unset optional fields are None, and a zero top_p or
    repetition_penalty means 1 (off). Sample i of a request draws with seed + i
    (`seed_offset`, mod 2**64); `with_prompt_logprobs=False` leaves prompt_logprobs out (the
    scheduler asks sample 0 only). Raises ValueError for a value out of its limits."""
    return SamplingParams(
        temperature=pb.temperature,
        top_p=pb.top_p or 1.0,
        top_k=pb.top_k,
        min_p=pb.min_p,
        repetition_penalty=pb.repetition_penalty or 1.0,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        logit_bias=tuple(sorted(pb.logit_bias.items())),
        seed=(pb.seed + seed_offset) % 2**64 if pb.HasField("seed") else None,
        min_tokens=pb.min_tokens,
        stop_token_ids=tuple(pb.stop_token_ids),
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        prompt_logprobs=(
            pb.prompt_logprobs if with_prompt_logprobs and pb.HasField("prompt_logprobs") else None
        ),
    )


def logprob_to_pb(logprob: Logprob) -> types_pb2.TokenLogprob:
    return types_pb2.TokenLogprob(
        token_id=logprob.token_id,
        logprob=logprob.logprob,
        top_logprobs=[types_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in logprob.top],
    )


def logprob_from_pb(pb: types_pb2.TokenLogprob) -> Logprob:
    return Logprob(pb.token_id, pb.logprob, tuple((t.token_id, t.logprob) for t in pb.top_logprobs))
