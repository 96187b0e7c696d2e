"""Validation of public `GenerateRequest`s: every field against its documented limit.

Errors name the field and the limit; the servicer returns them as INVALID_ARGUMENT before
any work starts. Pure logic over protobuf messages (no grpc, no tokenizer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from common.pb.tandem.v1 import generate_pb2

MAX_TEMPERATURE = 100.0
MAX_PROMPT_TEXT_BYTES = 4 * 1024 * 1024
MAX_CACHE_SALT_BYTES = 256


class InvalidArgumentError(ValueError):
    """A bad field; str(error) is the message returned to the client."""


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    default_max_tokens: int


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int


def validate_sampling(params: generate_pb2.SamplingParams) -> Sampling:
    temperature = params.temperature if params.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidArgumentError(
            f"sampling.temperature must be a finite number in [0, {MAX_TEMPERATURE:g}], "
            f"got {temperature}"
        )
    top_p = params.top_p if params.HasField("top_p") else 1.0
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidArgumentError(f"sampling.top_p must be in (0, 1], got {top_p}")
    top_k = params.top_k if params.HasField("top_k") else 0
    if top_k < -1:
        raise InvalidArgumentError(f"sampling.top_k must be >= -1 (-1 or 0 = off), got {top_k}")
    return Sampling(temperature=temperature, top_p=top_p, top_k=max(top_k, 0))


def validate_prompt_text(text: str) -> None:
    if not text:
        raise InvalidArgumentError("prompt.text must not be empty")
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > MAX_PROMPT_TEXT_BYTES:
        raise InvalidArgumentError(
            f"prompt.text must be at most {MAX_PROMPT_TEXT_BYTES} bytes, got {size}"
        )


def validate_prompt_ids(ids: Sequence[int], limits: ModelLimits, field: str) -> None:
    if not ids:
        raise InvalidArgumentError(f"{field} must not be empty")
    for index, token in enumerate(ids):
        if not 0 <= token < limits.vocab_size:
            raise InvalidArgumentError(
                f"{field}[{index}]={token} is outside the vocabulary [0, {limits.vocab_size})"
            )


def resolve_max_tokens(
    request: generate_pb2.GenerateRequest, num_prompt_tokens: int, limits: ModelLimits
) -> int:
    room = limits.max_model_len - num_prompt_tokens
    if not request.HasField("max_tokens"):
        if room < 1:
            raise InvalidArgumentError(
                f"prompt ({num_prompt_tokens} tokens) leaves no room in the context length "
                f"of {limits.max_model_len} tokens"
            )
        return min(limits.default_max_tokens, room)
    if request.max_tokens < 1:
        raise InvalidArgumentError(f"max_tokens must be >= 1, got {request.max_tokens}")
    if request.max_tokens > room:
        raise InvalidArgumentError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) must not "
            f"exceed the context length of {limits.max_model_len} tokens"
        )
    return request.max_tokens


def validate_cache_salt(salt: str) -> str:
    size = len(salt.encode("utf-8", errors="surrogatepass"))
    if size > MAX_CACHE_SALT_BYTES:
        raise InvalidArgumentError(
            f"cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes, got {size}"
        )
    return salt


def check_prompt_field(request: generate_pb2.GenerateRequest) -> str:
    """Return which prompt field is set ('text' or 'token_ids')."""
    which = request.WhichOneof("prompt")
    if which is None:
        raise InvalidArgumentError("prompt is required: set prompt.text or prompt.token_ids")
    return which
