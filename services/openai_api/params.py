"""The request fields `/v1/completions` and `/v1/chat/completions` share: sampling, stop
conditions, `n`, streaming options, vLLM's extras — written into a `GenerateRequest`, or
kept in `Options` when only the HTTP layer acts on them (`return_token_ids`,
`return_tokens_as_token_ids`). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.errors import ApiError, invalid
from services.openai_api.fields import INT64, UINT64, Fields, check_int, check_number, check_str
from services.openai_api.structured_request import read_structured

SAMPLING_NUMBERS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(frozen=True)
class Options:
    """What the HTTP layer itself needs to know about a request."""

    model: str | None
    n: int
    stream: bool
    include_usage: bool
    prompt_logprobs: int | None
    # vLLM's extras: the prompt's and each choice's token ids in the answer, and logprob
    # tokens written as "token_id:<id>".
    return_token_ids: bool = False
    tokens_as_ids: bool = False


def unsupported(fields: Fields, key: str, why: str) -> None:
    """A 400 when `key` is given (not null)."""
    if fields.get(key) is not None:
        raise ApiError(f"{key} is not supported: {why}", 400, key, "unsupported_parameter")


def read_common(fields: Fields, request: generate_pb2.GenerateRequest) -> Options:
    """Read the shared fields into `request`; returns the options the HTTP layer uses."""
    model = fields.str("model")
    sampling = request.sampling
    for key in SAMPLING_NUMBERS:
        value = fields.number(key)
        if value is not None:
            setattr(sampling, key, value)
    top_k = fields.int("top_k")
    if top_k is not None:
        sampling.top_k = top_k
    seed = fields.int("seed", UINT64)
    if seed is not None:
        sampling.seed = seed
    bias = fields.get("logit_bias")
    if bias is not None:
        sampling.logit_bias.update(read_logit_bias(bias))

    stopping = request.stopping
    stopping.stop.extend(read_stop(fields.get("stop")))
    ids = fields.list("stop_token_ids") or []
    stopping.stop_token_ids.extend(
        check_int(v, f"stop_token_ids[{i}]", INT64) for i, v in enumerate(ids)
    )
    for key in ("include_stop_str_in_output", "ignore_eos"):
        setattr(stopping, key, bool(fields.bool(key)))
    min_tokens = fields.int("min_tokens")
    if min_tokens is not None:
        stopping.min_tokens = min_tokens
    skip_special = fields.bool("skip_special_tokens")
    if skip_special is not None:
        stopping.skip_special_tokens = skip_special

    n = fields.int("n")
    if n is not None:
        request.n = n
    best_of = fields.int("best_of")
    if best_of is not None and best_of != (1 if n is None else n):
        raise ApiError(
            f"best_of is not supported unless it equals n (got best_of={best_of}, n={n or 1})",
            400,
            "best_of",
            "unsupported_parameter",
        )
    read_beam_search(fields, request, 1 if n is None else n)
    request.cache_salt = fields.str("cache_salt") or ""
    read_retention(fields, request)
    read_structured(fields, request)
    fields.str("user")  # accepted and ignored, as by OpenAI for anything but abuse reports

    prompt_logprobs = fields.int("prompt_logprobs")
    if prompt_logprobs is not None:
        request.prompt_logprobs = prompt_logprobs
    stream = bool(fields.bool("stream"))
    include_usage = read_stream_options(fields, stream)
    if stream and prompt_logprobs is not None:
        raise ApiError("prompt_logprobs is not supported with stream=true", 400, "prompt_logprobs")
    return Options(
        model=model,
        n=1 if n is None else n,
        stream=stream,
        include_usage=include_usage,
        prompt_logprobs=prompt_logprobs,
        return_token_ids=bool(fields.bool("return_token_ids")),
        tokens_as_ids=bool(fields.bool("return_tokens_as_token_ids")),
    )


EARLY_STOPPING = {
    False: generate_pb2.BEAM_EARLY_STOPPING_FALSE,
    True: generate_pb2.BEAM_EARLY_STOPPING_TRUE,
    "never": generate_pb2.BEAM_EARLY_STOPPING_NEVER,
}


def read_beam_search(fields: Fields, request: generate_pb2.GenerateRequest, n: int) -> None:
    """vLLM's `use_beam_search` (beam width = n, the n best hypotheses returned) with the
    `length_penalty` and `early_stopping` extras (transformers' meaning). Without beam
    search, only their defaults (1.0, false) are accepted: they would do nothing."""
    use = bool(fields.bool("use_beam_search"))
    length_penalty = fields.number("length_penalty")
    early = fields.get("early_stopping")
    if early is not None and (isinstance(early, str) and early != "never"):
        raise invalid("early_stopping", 'must be true, false or "never"')
    if early is not None and not isinstance(early, bool | str):
        raise invalid("early_stopping", 'must be true, false or "never"', "invalid_type")
    if not use:
        for key, value, default in (
            ("length_penalty", length_penalty, 1.0),
            ("early_stopping", early, False),
        ):
            if value is not None and value != default:
                raise ApiError(
                    f"{key} only applies with use_beam_search=true", 400, key, "invalid_value"
                )
        return
    request.beam_search.beam_width = n
    if length_penalty is not None:
        request.beam_search.length_penalty = length_penalty
    if early is not None:
        request.beam_search.early_stopping = EARLY_STOPPING[early]


def read_retention(fields: Fields, request: generate_pb2.GenerateRequest) -> None:
    """`kv_retention_s` (seconds to keep the request's KV once it finishes): a top-level
    field, or in vLLM's extension object `vllm_xargs` (whose other keys are unknown here:
    a 400, like any unknown parameter). Both given: they must agree. The gateway checks
    the limits (finite, >= 0, <= --max-kv-retention-s)."""
    top = fields.number("kv_retention_s")
    inner = None
    xargs = fields.get("vllm_xargs")
    if xargs is not None:
        extra = Fields(xargs, "vllm_xargs")
        inner = extra.number("kv_retention_s")
        extra.finish()
    if top is not None and inner is not None and top != inner:
        raise invalid(
            "kv_retention_s", f"given twice, differently ({top:g} and vllm_xargs' {inner:g})"
        )
    value = top if top is not None else inner
    if value is not None:
        request.kv_retention_s = value


def read_logit_bias(value) -> dict[int, float]:
    """OpenAI's {"token id": bias} (keys are strings in JSON)."""
    if not isinstance(value, dict):
        raise invalid("logit_bias", "must be an object of {token id: bias}", "invalid_type")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise invalid("logit_bias", f"keys must be token ids, got {key!r}") from None
        out[check_int(token, f"logit_bias[{key}]", INT64)] = check_number(
            bias, f"logit_bias[{key}]"
        )
    return out


def read_stop(value) -> list[str]:
    """`stop`: a string or an array of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [check_str(v, f"stop[{i}]") for i, v in enumerate(value)]
    raise invalid("stop", "must be a string or an array of strings", "invalid_type")


def read_stream_options(fields: Fields, stream: bool) -> bool:
    """`stream_options.include_usage` (only with stream=true, as OpenAI and vLLM require)."""
    value = fields.get("stream_options")
    if value is None:
        return False
    if not stream:
        raise ApiError("stream_options is only allowed with stream=true", 400, "stream_options")
    options = Fields(value, "stream_options")
    include_usage = bool(options.bool("include_usage"))
    if options.bool("continuous_usage_stats"):
        raise ApiError(
            "stream_options.continuous_usage_stats is not supported",
            400,
            "stream_options.continuous_usage_stats",
            "unsupported_parameter",
        )
    options.finish()
    return include_usage


def read_max_tokens(fields: Fields, key: str, request: generate_pb2.GenerateRequest) -> None:
    value = fields.int(key)
    if value is not None:
        request.max_tokens = value
