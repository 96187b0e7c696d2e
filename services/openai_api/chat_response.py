"""`GenerateResponse` messages -> `/v1/chat/completions` answers: one `chat.completion`
object, or `chat.completion.chunk`s for SSE (a `role` delta per choice first, then `content`
deltas, `finish_reason` on a choice's last chunk, an optional usage chunk at the end). Pure."""

from __future__ import annotations

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.collect import Collector, Meta, UsageSum, finish_reason, stop_reason
from services.openai_api.logprobs import chat_logprobs, prompt_logprobs

OBJECT = "chat.completion"
CHUNK_OBJECT = "chat.completion.chunk"
ROLE = "assistant"


def chat_body(meta: Meta, collected: Collector, logprobs: bool, with_prompt_logprobs: bool) -> dict:
    choices = [
        {
            "index": choice.index,
            "message": {"role": ROLE, "content": choice.text},
            "logprobs": {"content": chat_logprobs(choice.logprobs)} if logprobs else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        for choice in collected.sorted_choices()
    ]
    body = {**meta.head(OBJECT), "choices": choices, "usage": collected.usage.body()}
    if with_prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs(collected.prompt_logprobs.get(0, ()))
    return body


class ChatChunks:
    """Builds the SSE chunks of one streamed chat request, message by message."""

    def __init__(self, meta: Meta, n: int, logprobs: bool, include_usage: bool) -> None:
        self.meta = meta
        self.n = n
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.usage = UsageSum()

    def role_chunks(self) -> list[dict]:
        """The first chunk of every choice: the assistant role and empty content."""
        return [
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

    def chunk(self, response: generate_pb2.GenerateResponse) -> dict | None:
        """The chunk for one message, or None when it carries nothing at all. A message
        with new tokens is a chunk even when their text is empty (a partial UTF-8
        character, a skipped special token), as in vLLM: clients time tokens by chunks."""
        self.usage.add(response)
        reason = finish_reason(response)
        logprobs = None
        if self.logprobs and response.logprobs:
            logprobs = {"content": chat_logprobs(response.logprobs)}
        has_tokens = bool(response.token_ids)
        if not response.text and not has_tokens and logprobs is None and reason is None:
            return None
        return self._chunk(
            {
                "index": response.index,
                "delta": {"content": response.text} if response.text or has_tokens else {},
                "logprobs": logprobs,
                "finish_reason": reason,
                "stop_reason": stop_reason(response),
            }
        )

    def usage_chunk(self) -> dict | None:
        if not self.include_usage:
            return None
        return {**self.meta.head(CHUNK_OBJECT), "choices": [], "usage": self.usage.body()}

    def _chunk(self, choice: dict) -> dict:
        chunk = {**self.meta.head(CHUNK_OBJECT), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk
