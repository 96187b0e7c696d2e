"""Protobuf conversions of the shared sampling types (`common/sampling.py`) and of the
worker role, each direction written once: `SamplingParams` <-> `types_pb2.Sampling` (the
public `tandem.v1.SamplingParams`, every field set, and what the request adds), `Logprob`
<-> the public `tandem.v1.TokenLogprob` (no token text: the gateway adds it), role name <->
`types_pb2.WorkerRole`."""

from __future__ import annotations

from common.pb.tandem.internal.v1 import types_pb2
from common.pb.tandem.v1 import generate_pb2
from common.sampling import Logprob, SamplingParams

ROLE_FROM_PB = {
    types_pb2.WORKER_ROLE_PREFILL: "prefill",
    types_pb2.WORKER_ROLE_DECODE: "decode",
    types_pb2.WORKER_ROLE_BOTH: "both",
}
ROLE_TO_PB = {role: pb for pb, role in ROLE_FROM_PB.items()}

_PARAMS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty",
)  # fmt: skip


def sampling_to_pb(params: SamplingParams) -> types_pb2.Sampling:
    public = generate_pb2.SamplingParams(
        **{name: getattr(params, name) for name in _PARAMS}, logit_bias=dict(params.logit_bias)
    )
    if params.seed is not None:
        public.seed = params.seed
    message = types_pb2.Sampling(
        params=public, min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids
    )
    for name in ("logprobs", "prompt_logprobs"):  # unset on the wire = None
        value = getattr(params, name)
        if value is not None:
            setattr(message, name, value)
    return message


def sampling_from_pb(
    pb: types_pb2.Sampling, seed_offset: int = 0, with_prompt_logprobs: bool = True
) -> SamplingParams:
    """The message's settings: an unset field of `params` is that setting's default (off),
    unset logprobs are None. Sample i of a request draws with seed + i (`seed_offset`, mod
    2**64); `with_prompt_logprobs=False` leaves prompt_logprobs out (the scheduler asks
    sample 0 only). Raises ValueError for a value out of its limits."""
    public = pb.params
    resolved = {name: getattr(public, name) for name in _PARAMS if public.HasField(name)}
    return SamplingParams(
        **resolved,
        logit_bias=tuple(sorted(public.logit_bias.items())),
        seed=(public.seed + seed_offset) % 2**64 if public.HasField("seed") else None,
        min_tokens=pb.min_tokens,
        stop_token_ids=tuple(pb.stop_token_ids),
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        prompt_logprobs=(
            pb.prompt_logprobs if with_prompt_logprobs and pb.HasField("prompt_logprobs") else None
        ),
    )


def logprob_to_pb(logprob: Logprob) -> generate_pb2.TokenLogprob:
    return generate_pb2.TokenLogprob(
        token_id=logprob.token_id,
        logprob=logprob.logprob,
        top_logprobs=[generate_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in logprob.top],
    )


def logprob_from_pb(pb: generate_pb2.TokenLogprob) -> Logprob:
    return Logprob(pb.token_id, pb.logprob, tuple((t.token_id, t.logprob) for t in pb.top_logprobs))
