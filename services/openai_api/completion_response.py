"""`GenerateResponse` messages -> `/v1/completions` answers: one `text_completion` object,
or `text_completion` chunks for SSE (echo on a choice's first chunk, logprob text offsets
carried across chunks, an optional usage chunk at the end). With vLLM's `return_token_ids`
(`prompt_ids` given: one id list per prompt) each choice carries its prompt's
`prompt_token_ids` (streamed: on its first chunk) and its `token_ids` (streamed: each
chunk's own). Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.collect import (
    Collector,
    Meta,
    UsageSum,
    choice_index,
    finish_reason,
    stop_reason,
)
from services.openai_api.echo_logprobs import FirstToken, echoed_logprobs
from services.openai_api.logprobs import completion_logprobs, prompt_logprobs

OBJECT = "text_completion"


@dataclass(frozen=True)
class Echo:
    """What `echo` adds to each prompt's choices: its text, and with logprobs its first
    token and how many alternatives to show; `only`: max_tokens 0 (nothing generated)."""

    texts: Sequence[str]
    first_tokens: Sequence[FirstToken] | None = None
    k: int = 0
    only: bool = False


def completion_body(
    meta: Meta,
    collected: Collector,
    echo: Echo | None,
    logprobs: bool,
    with_prompt_logprobs: bool,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    tokens_as_ids: bool = False,
) -> dict:
    """The whole answer; `echo.texts[i]` is prepended to prompt i's choices when given."""
    choices = []
    for choice in collected.sorted_choices():
        prompt_index = choice.index // collected.n
        prefix = echo.texts[prompt_index] if echo is not None else ""
        generated = choice.logprobs
        if echo is not None and echo.only:  # max_tokens 0: the one token made is dropped
            choice.texts, generated = [], []
            choice.finish_reason, choice.stop_reason = "length", None
            collected.usage.completion_tokens -= len(choice.token_ids)
        if echo is not None and echo.first_tokens is not None:
            entries = collected.prompt_logprobs.get(prompt_index, ())
            first = echo.first_tokens[prompt_index]
            choice_logprobs = echoed_logprobs(first, entries, generated, echo.k, tokens_as_ids)
        else:
            choice_logprobs = (
                completion_logprobs(generated, 0, tokens_as_ids)[0] if logprobs else None
            )
        body = {
            "index": choice.index,
            "text": prefix + choice.text,
            "logprobs": choice_logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if prompt_ids is not None:
            body["prompt_token_ids"] = list(prompt_ids[prompt_index])
            body["token_ids"] = choice.token_ids
        if with_prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs(
                collected.prompt_logprobs.get(prompt_index, ())
            )
        choices.append(body)
    return {**meta.head(OBJECT), "choices": choices, "usage": collected.usage.body()}


class CompletionChunks:
    """Builds the SSE chunks of one streamed completion request, message by message."""

    def __init__(
        self,
        meta: Meta,
        n: int,
        echo_texts: Sequence[str] | None,
        logprobs: bool,
        include_usage: bool,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        tokens_as_ids: bool = False,
    ) -> None:
        self.meta = meta
        self.n = n
        self.echo_texts = echo_texts
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.prompt_ids = prompt_ids
        self.tokens_as_ids = tokens_as_ids
        self.usage = UsageSum()
        self._offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        self._started: set[int] = set()  # choices that sent a chunk

    def chunk(self, prompt_index: int, response: generate_pb2.GenerateResponse) -> dict | None:
        """The chunk for one message, or None when it carries nothing at all. A message
        with new tokens is a chunk even when their text is empty (a partial UTF-8
        character, a skipped special token), as in vLLM: clients time tokens by chunks."""
        self.usage.add(response)
        index = choice_index(prompt_index, self.n, response)
        text = response.text
        if index not in self._offsets:
            if self.echo_texts is not None:
                text = self.echo_texts[prompt_index] + text
            self._offsets[index] = 0
        logprobs = None
        if self.logprobs and response.logprobs:
            logprobs, self._offsets[index] = completion_logprobs(
                response.logprobs, self._offsets[index], self.tokens_as_ids
            )
        reason = finish_reason(response)
        if not text and not response.token_ids and logprobs is None and reason is None:
            return None
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": reason,
            "stop_reason": stop_reason(response, self.meta.eos_ids),
        }
        if self.prompt_ids is not None:
            if index not in self._started:
                choice["prompt_token_ids"] = list(self.prompt_ids[prompt_index])
            choice["token_ids"] = list(response.token_ids)
        self._started.add(index)
        return self._with_usage({**self.meta.head(OBJECT), "choices": [choice]})

    def usage_chunk(self) -> dict | None:
        if not self.include_usage:
            return None
        return {**self.meta.head(OBJECT), "choices": [], "usage": self.usage.body()}

    def _with_usage(self, chunk: dict) -> dict:
        if self.include_usage:
            chunk["usage"] = None
        return chunk
