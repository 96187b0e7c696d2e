"""Reading `GenerateResponse` messages: finish and stop reasons in OpenAI's words, usage
summed over prompts, and whole choices accumulated for non-streaming answers. Pure.

A completion choice's index is `prompt_index * n + sample_index` (one prompt: the sample).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.pb.tandem.v1 import generate_pb2

FINISH_REASONS = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
    generate_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


def finish_reason(response: generate_pb2.GenerateResponse) -> str | None:
    return FINISH_REASONS.get(response.finish_reason)


def stop_reason(
    response: generate_pb2.GenerateResponse, eos_ids: frozenset[int] = frozenset()
) -> str | int | None:
    """The stop string or stop token id that ended the sample (vLLM's `stop_reason`: None
    for an end-of-sequence token, `eos_ids`, that the request did not list itself)."""
    which = response.WhichOneof("stop_reason")
    if which is None or (which == "stop_token_id" and response.stop_token_id in eos_ids):
        return None
    return getattr(response, which)


def choice_index(prompt_index: int, n: int, response: generate_pb2.GenerateResponse) -> int:
    return prompt_index * n + response.index


@dataclass
class UsageSum:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int | None = None  # with the gateway's --reasoning-parser

    def add(self, response: generate_pb2.GenerateResponse) -> None:
        if response.HasField("usage"):
            self.prompt_tokens += response.usage.prompt_tokens
            self.completion_tokens += response.usage.completion_tokens
            self.cached_tokens += response.usage.cached_tokens
        if response.parsed.HasField("reasoning_tokens"):
            self.reasoning_tokens = (self.reasoning_tokens or 0) + response.parsed.reasoning_tokens

    def body(self) -> dict:
        body = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.reasoning_tokens is not None:
            body["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return body


@dataclass
class Choice:
    index: int
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[generate_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # The gateway's parse of the whole answer (tools or a reasoning parser), if any.
    parsed: generate_pb2.ParsedMessage | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


class Collector:
    """Every message of a finished request, folded into choices, usage and prompt logprobs."""

    def __init__(self, n: int, eos_ids: frozenset[int] = frozenset()) -> None:
        self.n = n
        self.eos_ids = eos_ids
        self.usage = UsageSum()
        self.choices: dict[int, Choice] = {}
        self.prompt_logprobs: dict[int, list[generate_pb2.TokenLogprob]] = {}

    def add(self, prompt_index: int, response: generate_pb2.GenerateResponse) -> None:
        self.usage.add(response)
        if response.prompt_logprobs:
            self.prompt_logprobs[prompt_index] = list(response.prompt_logprobs)
        index = choice_index(prompt_index, self.n, response)
        choice = self.choices.setdefault(index, Choice(index))
        choice.texts.append(response.text)
        choice.token_ids.extend(response.token_ids)
        choice.logprobs.extend(response.logprobs)
        if response.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            choice.finish_reason = finish_reason(response)
            choice.stop_reason = stop_reason(response, self.eos_ids)
        if response.HasField("parsed"):
            choice.parsed = response.parsed

    def sorted_choices(self) -> list[Choice]:
        return [self.choices[i] for i in sorted(self.choices)]


@dataclass(frozen=True)
class Meta:
    """What every response object of one HTTP request carries."""

    id: str
    created: int
    model: str
    # End-of-sequence ids whose stop is no `stop_reason` (those the request did not list).
    eos_ids: frozenset[int] = frozenset()

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}
