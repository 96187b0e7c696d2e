"""Validation of public `GenerateRequest`s: every field against its documented limit.

Errors name the field and the limit; the servicer returns them as INVALID_ARGUMENT before
any work starts. Each limit here is a row of the table in docs/api.md (a test keeps the two
in step). Pure logic over protobuf messages (no grpc, no tokenizer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from common.pb.tandem.v1 import generate_pb2
from common.retention import RetentionLimits
from common.sampling import (
    API_DEFAULT_TEMPERATURE,
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_LOGIT_BIAS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    SamplingParams,
)

MAX_PROMPT_TEXT_BYTES = 4 * 1024 * 1024
MAX_CACHE_SALT_BYTES = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_CHAT_MESSAGES = 1024
CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_DETOKENIZE_IDS = 1 << 20


class InvalidArgumentError(ValueError):
    """A bad field; str(error) is the message returned to the client."""


class NotFoundError(LookupError):
    """A named thing the server does not have (a LoRA adapter); returned as NOT_FOUND."""


def validate_lora_name(name: str, loaded) -> str:
    """'' (the base model) or one of the loaded adapters."""
    if name and name not in loaded:
        served = ", ".join(loaded) if loaded else "none (start the workers with --enable-lora)"
        raise NotFoundError(f"lora_name {name!r} is not a loaded LoRA adapter; loaded: {served}")
    return name


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    default_max_tokens: int


@dataclass(frozen=True)
class Stopping:
    """Resolved stop conditions and output options."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True


def _finite_in(value: float, low: float, high: float, field: str, note: str = "") -> float:
    if not math.isfinite(value) or not low <= value <= high:
        raise InvalidArgumentError(
            f"{field} must be a finite number in [{low:g}, {high:g}]{note}, got {value}"
        )
    return value


# What an unset public field means: `SamplingParams`' defaults, but the API's temperature.
_API_DEFAULTS = SamplingParams(temperature=API_DEFAULT_TEMPERATURE)


def validate_sampling(params: generate_pb2.SamplingParams, limits: ModelLimits) -> SamplingParams:
    """The public settings, every limit checked with an error naming the public field
    (min_tokens, logprobs and prompt_logprobs come from other fields of the request)."""

    def get(name: str):
        return getattr(params, name) if params.HasField(name) else getattr(_API_DEFAULTS, name)

    temperature = _finite_in(get("temperature"), 0.0, MAX_TEMPERATURE, "sampling.temperature")
    top_p = get("top_p")
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidArgumentError(f"sampling.top_p must be in (0, 1], got {top_p}")
    top_k = get("top_k")
    if top_k < -1:
        raise InvalidArgumentError(f"sampling.top_k must be >= -1 (-1 or 0 = off), got {top_k}")
    min_p = _finite_in(get("min_p"), 0.0, 1.0, "sampling.min_p")
    repetition = get("repetition_penalty")
    if not math.isfinite(repetition) or not 0.0 < repetition <= MAX_REPETITION_PENALTY:
        raise InvalidArgumentError(
            f"sampling.repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] "
            f"(1 = off), got {repetition}"
        )
    presence = _finite_in(
        get("presence_penalty"), -MAX_ABS_PENALTY, MAX_ABS_PENALTY, "sampling.presence_penalty"
    )
    frequency = _finite_in(
        get("frequency_penalty"),
        -MAX_ABS_PENALTY,
        MAX_ABS_PENALTY,
        "sampling.frequency_penalty",
    )
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        min_p=min_p,
        repetition_penalty=repetition,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logit_bias=validate_logit_bias(params.logit_bias, limits),
        seed=get("seed"),
    )


def validate_logit_bias(bias, limits: ModelLimits) -> tuple[tuple[int, float], ...]:
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidArgumentError(
            f"sampling.logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}"
        )
    for token, value in bias.items():
        if not 0 <= token < limits.vocab_size:
            raise InvalidArgumentError(
                f"sampling.logit_bias key {token} is outside the vocabulary "
                f"[0, {limits.vocab_size})"
            )
        _finite_in(value, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS, f"sampling.logit_bias[{token}]")
    return tuple(sorted(bias.items()))


def validate_stopping(
    params: generate_pb2.StoppingParams, limits: ModelLimits, max_tokens: int
) -> Stopping:
    stop = list(params.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgumentError(
            f"stopping.stop must have at most {MAX_STOP_STRINGS} strings, got {len(stop)}"
        )
    for index, text in enumerate(stop):
        if not 1 <= len(text) <= MAX_STOP_STRING_CHARS:
            raise InvalidArgumentError(
                f"stopping.stop[{index}] must be 1..{MAX_STOP_STRING_CHARS} characters, "
                f"got {len(text)}"
            )
    ids = list(params.stop_token_ids)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgumentError(
            f"stopping.stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
        )
    check_token_ids(ids, limits, "stopping.stop_token_ids")
    min_tokens = params.min_tokens if params.HasField("min_tokens") else 0
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidArgumentError(
            f"stopping.min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}"
        )
    return Stopping(
        stop=tuple(stop),
        include_stop_str_in_output=params.include_stop_str_in_output,
        stop_token_ids=tuple(dict.fromkeys(ids)),
        ignore_eos=params.ignore_eos,
        min_tokens=min_tokens,
        skip_special_tokens=(
            params.skip_special_tokens if params.HasField("skip_special_tokens") else True
        ),
    )


def validate_count(request, field: str, low: int, high: int, default: int | None) -> int | None:
    """An optional int field that must lie in [low, high] when set."""
    if not request.HasField(field):
        return default
    value = getattr(request, field)
    if not low <= value <= high:
        raise InvalidArgumentError(f"{field} must be in [{low}, {high}], got {value}")
    return value


def validate_text(text: str, field: str, allow_empty: bool = False) -> None:
    if not text and not allow_empty:
        raise InvalidArgumentError(f"{field} must not be empty")
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > MAX_PROMPT_TEXT_BYTES:
        raise InvalidArgumentError(
            f"{field} must be at most {MAX_PROMPT_TEXT_BYTES} bytes, got {size}"
        )


def validate_chat(chat: generate_pb2.ChatMessages, field: str = "prompt.chat") -> list[dict]:
    """The messages as the chat template expects them ([{role, content}, ...])."""
    messages = chat.messages
    if not 1 <= len(messages) <= MAX_CHAT_MESSAGES:
        raise InvalidArgumentError(
            f"{field}.messages must hold 1..{MAX_CHAT_MESSAGES} messages, got {len(messages)}"
        )
    size = 0
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgumentError(
                f"{field}.messages[{index}].role must be one of {', '.join(CHAT_ROLES)}, "
                f"got {message.role!r}"
            )
        size += len(message.content.encode("utf-8", errors="surrogatepass"))
    if size > MAX_PROMPT_TEXT_BYTES:
        raise InvalidArgumentError(
            f"{field} content must be at most {MAX_PROMPT_TEXT_BYTES} bytes in all, got {size}"
        )
    return [{"role": m.role, "content": m.content} for m in messages]


def check_token_ids(ids: Sequence[int], limits: ModelLimits, field: str) -> None:
    for index, token in enumerate(ids):
        if not 0 <= token < limits.vocab_size:
            raise InvalidArgumentError(
                f"{field}[{index}]={token} is outside the vocabulary [0, {limits.vocab_size})"
            )


def validate_prompt_ids(ids: Sequence[int], limits: ModelLimits, field: str) -> None:
    if not ids:
        raise InvalidArgumentError(f"{field} must not be empty")
    check_token_ids(ids, limits, field)


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


def validate_retention(request: generate_pb2.GenerateRequest, limits: RetentionLimits) -> float:
    """`kv_retention_s`: unset is 0 (none); else finite, >= 0, <= the configured maximum."""
    if not request.HasField("kv_retention_s"):
        return 0.0
    problem = limits.problem(request.kv_retention_s)
    if problem is not None:
        raise InvalidArgumentError(problem)
    return request.kv_retention_s


def validate_cache_salt(salt: str) -> str:
    size = len(salt.encode("utf-8", errors="surrogatepass"))
    if size > MAX_CACHE_SALT_BYTES:
        raise InvalidArgumentError(
            f"cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes, got {size}"
        )
    return salt


def check_prompt_field(request: generate_pb2.GenerateRequest) -> str:
    """Return which prompt field is set ('text', 'token_ids' or 'chat')."""
    which = request.WhichOneof("prompt")
    if which is None:
        raise InvalidArgumentError(
            "prompt is required: set prompt.text, prompt.token_ids or prompt.chat"
        )
    return which
