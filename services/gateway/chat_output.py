"""One sample's answer split as vLLM splits it (`--reasoning-parser`, `--tool-call-parser`,
tool_choice): reasoning first, then content, with tool calls parsed from the content.

`ChatParsing` is what one request asks (frozen); `ChatOutput` follows one sample: every
`GenerateResponse` of it is rewritten in place so that `text` holds only content, with the
new pieces of reasoning (`reasoning_content`) and of calls (`tool_calls`) beside it, as
vLLM streams them; the sample's last message also gets `parsed`, the whole answer parsed
at its end as vLLM's non-streaming answer is (arguments re-serialized), and, when calls
were streamed, finish reason TOOL_CALLS. No grpc."""

from __future__ import annotations

from dataclasses import dataclass

from common.pb.tandem.v1 import generate_pb2
from services.gateway.chat_tools import AUTO, FUNCTION, REQUIRED, ToolRequest
from services.gateway.reasoning_parsers.think import ThinkFormat
from services.gateway.tool_parsers.base import Extracted, StreamDelta, ToolParser, openai_call_id
from services.gateway.tool_parsers.forced import (
    NamedStream,
    RequiredStream,
    extract_named,
    extract_required,
)

STOP = generate_pb2.FINISH_REASON_STOP
TOOL_CALLS = generate_pb2.FINISH_REASON_TOOL_CALLS


@dataclass(frozen=True)
class ParserSettings:
    """The gateway's parser flags (vLLM's names)."""

    tool_call_parser: str = ""
    enable_auto_tool_choice: bool = False
    reasoning_parser: str = ""


@dataclass(frozen=True)
class ChatParsing:
    """How to split one request's samples."""

    reasoning: ThinkFormat | None = None
    # The prompt closed its reasoning block (streamed answers start in the content).
    reasoning_ended_in_prompt: bool = False
    tools: ToolRequest | None = None
    # --tool-call-parser with --enable-auto-tool-choice: tool_choice auto is parsed.
    auto_parser: ToolParser | None = None
    # With --reasoning-parser: the ids of its start and end tags (reasoning tokens are
    # counted between them, as vLLM counts), even when this request's answer is not split.
    think_ids: tuple[int, int] | None = None

    @property
    def tool_mode(self) -> str | None:
        """What splits calls from content: auto, required, function, or None (no calls)."""
        if self.tools is None:
            return None
        if self.tools.forced:
            return self.tools.choice
        if self.tools.choice == AUTO and self.auto_parser is not None:
            return AUTO
        return None

    def new_id(self) -> str:
        """A tool call id in the parser's style (vLLM's otherwise)."""
        return self.auto_parser.new_id() if self.auto_parser is not None else openai_call_id()

    def sample(self) -> ChatOutput:
        return ChatOutput(self)


def count_between(ids: list[int], start: int, end: int) -> int:
    """Tokens inside start..end spans (nested spans counted once, stray ends ignored)."""
    count = depth = 0
    for token in ids:
        if token == start:
            depth += 1
        elif token == end:
            depth = max(depth - 1, 0)
        elif depth:
            count += 1
    return count


class ChatOutput:
    def __init__(self, parsing: ChatParsing) -> None:
        self.parsing = parsing
        self.text = ""
        self.token_ids: list[int] = []
        self.content = ""  # the text after the reasoning
        self.think = (
            parsing.reasoning.stream(parsing.reasoning_ended_in_prompt)
            if (parsing.reasoning)
            else None
        )
        self.calls_streamed = False
        self.ids: dict[int, str] = {}
        mode, tools = parsing.tool_mode, parsing.tools
        if mode == AUTO:
            self.calls = parsing.auto_parser.stream()
        elif mode == REQUIRED:
            self.calls = RequiredStream(parsing.new_id)
        elif mode == FUNCTION:
            self.calls = NamedStream(tools.function, parsing.new_id)
        else:
            self.calls = None

    def rewrite(self, message: generate_pb2.GenerateResponse) -> None:
        """Split `message` (this sample's next one) in place."""
        self.text += message.text
        self.token_ids.extend(message.token_ids)
        reasoning, content = "", message.text
        if self.think is not None:
            final = message.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
            reasoning, content = self.think.feed(self.text, final)
        self.content += content
        delta = StreamDelta(content)
        if self.calls is not None and (self.content or message.finish_reason):
            delta = self.calls.feed(self.content)
        calls = delta.calls
        if self.parsing.tools is not None and not self.parsing.tools.parallel:
            calls = [c for c in calls if c.index == 0]
        message.text = delta.content
        message.reasoning_content = reasoning
        for call in calls:
            piece = message.tool_calls.add(index=call.index, id=call.id or "", name=call.name or "")
            if call.arguments is not None:
                piece.arguments = call.arguments
            if call.id:
                self.ids[call.index] = call.id
        self.calls_streamed = self.calls_streamed or bool(calls)
        if message.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            self._finish(message)

    def _finish(self, message: generate_pb2.GenerateResponse) -> None:
        mode = self.parsing.tool_mode
        reason = message.finish_reason
        message.parsed.CopyFrom(self.parse(reason))
        if self.calls_streamed and mode != FUNCTION and reason == STOP:
            message.finish_reason = TOOL_CALLS

    def parse(self, reason: int) -> generate_pb2.ParsedMessage:
        """The whole answer, as vLLM's non-streaming answer gives it."""
        reasoning, content = None, self.text
        if self.parsing.reasoning is not None and not self.parsing.reasoning_ended_in_prompt:
            split = self.parsing.reasoning.split(self.text)
            reasoning, content = split.reasoning, split.content
        mode, tools = self.parsing.tool_mode, self.parsing.tools
        extracted = Extracted(content)
        if mode == FUNCTION:
            extracted = extract_named(content or "", tools.function)
        elif mode == REQUIRED:
            extracted = extract_required(content or "")
        elif mode == AUTO:
            found = self.parsing.auto_parser.extract(content or "")
            if found.calls:
                text = found.content
                extracted = Extracted(text if text and text.strip() else None, found.calls)
        calls = extracted.calls[:1] if tools is not None and not tools.parallel else extracted.calls
        out = generate_pb2.ParsedMessage(finish_reason=reason)
        text = extracted.content
        if mode in (REQUIRED, FUNCTION):
            text = text or ""  # vLLM: "" beside forced calls
        if text is not None:
            out.content = text
        if reasoning is not None:
            out.reasoning_content = reasoning
        for index, call in enumerate(calls):
            call_id = self.ids.get(index) or self._new_id()
            out.tool_calls.add(id=call_id, name=call.name, arguments=call.arguments)
        if reason == STOP and ((mode == AUTO and calls) or mode == REQUIRED):
            out.finish_reason = TOOL_CALLS
        if self.parsing.think_ids is not None:
            out.reasoning_tokens = count_between(self.token_ids, *self.parsing.think_ids)
        return out

    def _new_id(self) -> str:
        return self.parsing.new_id()
