"""`/v1/completions` JSON body -> one `GenerateRequest` per prompt (a batch of prompts runs
as concurrent Generate calls). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.errors import ApiError, invalid
from services.openai_api.fields import INT64, Fields, check_int, is_int
from services.openai_api.params import Options, read_common, read_max_tokens, unsupported

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions
MAX_BATCH_PROMPTS = 256
PROMPT_SHAPES = (
    "must be a string, an array of token ids, an array of strings or an array of token-id arrays"
)

Prompt = str | list[int]


@dataclass(frozen=True)
class CompletionRequest:
    options: Options
    prompts: tuple[Prompt, ...]
    requests: tuple[generate_pb2.GenerateRequest, ...]  # one per prompt, same order
    echo: bool
    logprobs: int | None
    # echo with logprobs: the prompt's tokens lead the logprobs (echo_logprobs.py); with
    # max_tokens 0 nothing is generated (one token is, and dropped, as vLLM does).
    echo_logprobs: bool = False
    echo_only: bool = False


def read_prompts(value) -> list[Prompt]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise invalid("prompt", PROMPT_SHAPES, "invalid_type")
    if all(is_int(v) for v in value):
        return [[check_int(v, f"prompt[{i}]", INT64) for i, v in enumerate(value)]]
    if len(value) > MAX_BATCH_PROMPTS:
        raise invalid("prompt", f"at most {MAX_BATCH_PROMPTS} prompts, got {len(value)}")
    prompts: list[Prompt] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list):
            prompts.append([check_int(v, f"prompt[{i}][{j}]", INT64) for j, v in enumerate(item)])
        else:
            raise invalid(f"prompt[{i}]", "must be a string or an array of token ids")
    return prompts


def parse_completion(body) -> CompletionRequest:
    fields = Fields(body)
    prompts = read_prompts(fields.required("prompt"))
    template = generate_pb2.GenerateRequest()
    options = read_common(fields, template)
    if fields.missing("max_tokens"):
        template.max_tokens = DEFAULT_MAX_TOKENS
    read_max_tokens(fields, "max_tokens", template)  # null: until the context ends
    logprobs = fields.int("logprobs")
    if logprobs is not None:
        template.logprobs = logprobs
    echo = bool(fields.bool("echo"))
    echo_logprobs = echo and logprobs is not None
    if echo_logprobs:
        if options.stream:
            raise ApiError(
                "echo with logprobs is not supported with stream=true", 400, "echo",
                "unsupported_parameter",
            )  # fmt: skip
        template.prompt_logprobs = max(logprobs, template.prompt_logprobs)
    echo_only = echo and template.HasField("max_tokens") and template.max_tokens == 0
    if echo_only:
        template.max_tokens = 1  # the gateway generates at least one; it is dropped
    unsupported(fields, "suffix", "insertion (fill-in-the-middle) is not implemented")
    fields.finish()
    requests = []
    for prompt in prompts:
        request = generate_pb2.GenerateRequest()
        request.CopyFrom(template)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        requests.append(request)
    return CompletionRequest(
        options, tuple(prompts), tuple(requests), echo, logprobs, echo_logprobs, echo_only
    )
