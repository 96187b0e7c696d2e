"""The gateway's checks of a beam search request (`GenerateRequest.beam_search`): its own
limits, and every other field that beam search does not support, each refused naming the
field (INVALID_ARGUMENT). Beam search is Hugging Face's `generate(num_beams=k,
do_sample=False)`: the search ranks raw logprobs, so anything that reshapes or samples the
distribution (temperature, top-k/p, min-p, penalties, logit_bias), logprobs outputs, text
stops, min_tokens and grammars are refused rather than silently ignored. Pure logic over
protobuf messages.
"""

from __future__ import annotations

import math

from common.pb.tandem.internal.v1 import scheduler_pb2
from common.pb.tandem.v1 import generate_pb2
from common.sampling import MAX_BEAM_WIDTH, MAX_INTERNAL_LOGPROBS
from services.gateway.validation import InvalidArgumentError

EARLY_STOPPING = {
    generate_pb2.BEAM_EARLY_STOPPING_UNSPECIFIED: "false",
    generate_pb2.BEAM_EARLY_STOPPING_FALSE: "false",
    generate_pb2.BEAM_EARLY_STOPPING_TRUE: "true",
    generate_pb2.BEAM_EARLY_STOPPING_NEVER: "never",
}

# Sampling fields and their "off" values: the only values beam search accepts.
_SAMPLING_OFF = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": (0, -1),
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def validate_beam_search(
    request: generate_pb2.GenerateRequest,
) -> scheduler_pb2.BeamSearch | None:
    """The internal form of `request.beam_search` (None when unset), or InvalidArgumentError
    naming the first field beam search refuses. `n` (1..beam_width), the stop token ids
    (the search's EOS ids with the model's) and max_tokens are checked by the caller's
    other checks plus `check_beam_counts`."""
    if not request.HasField("beam_search"):
        return None
    beam = request.beam_search
    if not 1 <= beam.beam_width <= MAX_BEAM_WIDTH:
        raise InvalidArgumentError(
            f"beam_search.beam_width must be in [1, {MAX_BEAM_WIDTH}], got {beam.beam_width}"
        )
    length_penalty = beam.length_penalty if beam.HasField("length_penalty") else 1.0
    if not math.isfinite(length_penalty):
        raise InvalidArgumentError(
            f"beam_search.length_penalty must be a finite number, got {length_penalty}"
        )
    if beam.early_stopping not in EARLY_STOPPING:
        raise InvalidArgumentError(
            f"beam_search.early_stopping must be a BeamEarlyStopping, got {beam.early_stopping}"
        )
    n = request.n if request.HasField("n") else 1
    if not 1 <= n <= beam.beam_width:
        raise InvalidArgumentError(
            f"n must be in [1, beam_search.beam_width={beam.beam_width}] with beam search, got {n}"
        )
    sampling = request.sampling
    for name, off in _SAMPLING_OFF.items():
        if sampling.HasField(name) and getattr(sampling, name) not in (
            off if isinstance(off, tuple) else (off,)
        ):
            raise InvalidArgumentError(
                f"sampling.{name} is not supported with beam_search (it ranks raw logprobs, "
                f"as Hugging Face's do_sample=False): leave it unset"
            )
    if sampling.logit_bias:
        raise InvalidArgumentError("sampling.logit_bias is not supported with beam_search")
    for name in ("logprobs", "prompt_logprobs"):
        if request.HasField(name):
            raise InvalidArgumentError(f"{name} is not supported with beam_search")
    if request.stopping.stop:
        raise InvalidArgumentError(
            "stopping.stop is not supported with beam_search (stop strings; use "
            "stopping.stop_token_ids, which end hypotheses as EOS does)"
        )
    if request.stopping.HasField("min_tokens") and request.stopping.min_tokens:
        raise InvalidArgumentError("stopping.min_tokens is not supported with beam_search")
    if request.HasField("structured_output"):
        raise InvalidArgumentError("structured_output is not supported with beam_search")
    return scheduler_pb2.BeamSearch(
        beam_width=beam.beam_width,
        length_penalty=length_penalty,
        early_stopping=EARLY_STOPPING[beam.early_stopping],
    )


def check_beam_counts(beam: scheduler_pb2.BeamSearch, num_stop_ids: int) -> None:
    """The search asks a worker for max(2, 1 + EOS ids) * beam_width candidates per beam."""
    needed = max(2, 1 + num_stop_ids) * beam.beam_width
    if needed > MAX_INTERNAL_LOGPROBS:
        raise InvalidArgumentError(
            f"stopping.stop_token_ids: with beam_search, (1 + stop tokens incl. EOS) * "
            f"beam_width must be at most {MAX_INTERNAL_LOGPROBS}, got {needed}"
        )
