"""`GenerateResponse` messages -> `/v1/chat/completions` answers: one `chat.completion`
object, or `chat.completion.chunk`s for SSE (a `role` delta per choice first, then `content`
deltas, `finish_reason` on a choice's last chunk, an optional usage chunk at the end). With
vLLM's `return_token_ids` (`prompt_ids` given) the answer carries `prompt_token_ids`
(streamed: on the first chunk) and each choice its `token_ids` (streamed: each chunk's
own; none on the role chunks). Pure."""

from __future__ import annotations

from collections.abc import Sequence

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.chat_message import ROLE, delta_body, message_body, parsed_finish_reason
from services.openai_api.collect import Collector, Meta, UsageSum, finish_reason, stop_reason
from services.openai_api.logprobs import chat_logprobs, prompt_logprobs

OBJECT = "chat.completion"
CHUNK_OBJECT = "chat.completion.chunk"


def chat_body(
    meta: Meta,
    collected: Collector,
    logprobs: bool,
    with_prompt_logprobs: bool,
    prompt_ids: Sequence[int] | None = None,
    tokens_as_ids: bool = False,
) -> dict:
    choices = []
    for choice in collected.sorted_choices():
        body = {
            "index": choice.index,
            "message": message_body(choice.text, choice.parsed),
            "logprobs": (
                {"content": chat_logprobs(choice.logprobs, tokens_as_ids)} if logprobs else None
            ),
            "finish_reason": parsed_finish_reason(choice.parsed, choice.finish_reason),
            "stop_reason": choice.stop_reason,
        }
        if prompt_ids is not None:
            body["token_ids"] = choice.token_ids
        choices.append(body)
    body = {**meta.head(OBJECT), "choices": choices, "usage": collected.usage.body()}
    if with_prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs(collected.prompt_logprobs.get(0, ()))
    if prompt_ids is not None:
        body["prompt_token_ids"] = list(prompt_ids)
    return body


class ChatChunks:
    """Builds the SSE chunks of one streamed chat request, message by message."""

    def __init__(
        self,
        meta: Meta,
        n: int,
        logprobs: bool,
        include_usage: bool,
        prompt_ids: Sequence[int] | None = None,
        tokens_as_ids: bool = False,
    ) -> None:
        self.meta = meta
        self.n = n
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.prompt_ids = prompt_ids
        self.tokens_as_ids = tokens_as_ids
        self.usage = UsageSum()

    def role_chunks(self) -> list[dict]:
        """The first chunk of every choice: the assistant role and empty content (the very
        first with the prompt's token ids, when asked for)."""
        chunks = [
            self._chunk(
                {
                    "index": index,
                    "delta": {"role": ROLE, "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
            for index in range(self.n)
        ]
        if self.prompt_ids is not None:
            chunks[0]["prompt_token_ids"] = list(self.prompt_ids)
        return chunks

    def chunk(self, response: generate_pb2.GenerateResponse) -> dict | None:
        """The chunk for one message, or None when it carries nothing at all. A message
        with new tokens is a chunk even when their text is empty (a partial UTF-8
        character, a skipped special token), as in vLLM: clients time tokens by chunks."""
        self.usage.add(response)
        reason = finish_reason(response)
        logprobs = None
        if self.logprobs and response.logprobs:
            logprobs = {"content": chat_logprobs(response.logprobs, self.tokens_as_ids)}
        delta = delta_body(response)
        if not delta and logprobs is None and reason is None:
            return None
        choice = {
            "index": response.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": reason,
            "stop_reason": stop_reason(response, self.meta.eos_ids),
        }
        if self.prompt_ids is not None:
            choice["token_ids"] = list(response.token_ids)
        return self._chunk(choice)

    def usage_chunk(self) -> dict | None:
        if not self.include_usage:
            return None
        return {**self.meta.head(CHUNK_OBJECT), "choices": [], "usage": self.usage.body()}

    def _chunk(self, choice: dict) -> dict:
        chunk = {**self.meta.head(CHUNK_OBJECT), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk
