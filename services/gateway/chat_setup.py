"""What the gateway's parser flags make of one chat request: its tools checked against
them (tool_choice auto needs `--tool-call-parser`), the grammar that forces a call
(each function's schema compiled first, so a bad one is named), how its answers are split
(`ChatParsing`), the grammar starting after the reasoning, and whether special tokens stay
in the text. No grpc: the servicer calls
it while it prepares a request."""

from __future__ import annotations

import json
from dataclasses import replace

from common.pb.tandem.v1 import generate_pb2
from services.gateway.chat_output import ChatParsing, ParserSettings
from services.gateway.chat_tools import AUTO, FUNCTION, NONE, ToolRequest, validate_tools
from services.gateway.reasoning_parsers import reasoning_parser
from services.gateway.reasoning_parsers.grammar import after_reasoning
from services.gateway.tool_parsers import tool_parser
from services.gateway.validation import InvalidArgumentError


class ChatSetup:
    def __init__(self, settings: ParserSettings, tokenizer) -> None:
        self.settings = settings
        name = settings.tool_call_parser
        self.tool_parser = tool_parser(name) if name else None
        name = settings.reasoning_parser
        self.reasoning = reasoning_parser(name) if name else None
        self.think_ids = None  # the reasoning tags' ids, when each is one token
        if self.reasoning is not None:
            vocab = tokenizer.get_vocab()
            ids = (vocab.get(self.reasoning.start), vocab.get(self.reasoning.end))
            self.think_ids = None if None in ids else ids

    def tools(self, request: generate_pb2.GenerateRequest) -> ToolRequest | None:
        """The request's tools, checked (InvalidArgumentError naming the field)."""
        tools = validate_tools(request)
        if tools is not None and tools.choice == AUTO and self.tool_parser is None:
            raise InvalidArgumentError(
                'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set"
            )
        return tools

    async def forced_calls(self, tools: ToolRequest | None, checker):
        """The grammar of a forced call (tool_choice required or a named function), checked
        by `checker` (the structured-output ConstraintChecker); None: no call forced."""
        if tools is None or not tools.forced:
            return None
        for index, function in enumerate(tools.functions):
            if function.parameters is None or (
                tools.choice == FUNCTION and function.name != tools.function
            ):
                continue
            schema = generate_pb2.StructuredOutput(json_schema=json.dumps(function.parameters))
            try:
                await checker.check(schema)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(
                    f"tools[{index}].parameters_json does not compile as a JSON schema: {exc}"
                ) from None
        try:
            forced = generate_pb2.StructuredOutput(json_schema=tools.forced_schema())
        except ValueError as exc:
            raise InvalidArgumentError(f"tools[*].parameters_json: {exc}") from None
        await checker.check(forced)
        return forced

    def parsing(
        self, request: generate_pb2.GenerateRequest, tools: ToolRequest | None, decode_prompt
    ) -> ChatParsing | None:
        """How the request's answers are split (None: they are not). `decode_prompt()`:
        the prompt's text, asked for only with a reasoning parser."""
        if request.WhichOneof("prompt") != "chat":
            return None
        auto = self.tool_parser if self.settings.enable_auto_tool_choice else None
        parsing = ChatParsing(self.reasoning, False, tools, auto, self.think_ids)
        if self.reasoning is None and parsing.tool_mode is None:
            return None
        if self.reasoning is not None:
            ended = self.reasoning.ends_in(decode_prompt())
            parsing = replace(parsing, reasoning_ended_in_prompt=ended)
        return parsing

    def constraint(self, given, parsing: ChatParsing | None):
        """The grammar a request's samples follow: `given` (a forced call's, or the
        request's structured_output; None: none), starting after the reasoning when the
        answer begins with reasoning (as vLLM starts it)."""
        if given is None or parsing is None or parsing.reasoning is None:
            return given
        if parsing.reasoning_ended_in_prompt:
            return given
        return after_reasoning(given, parsing.reasoning.end)

    def keeps_special_tokens(self, tools: ToolRequest | None) -> bool:
        """Whether the answer's special tokens stay in its text (vLLM's hermes: a call's
        markers may be special tokens)."""
        return (
            tools is not None
            and tools.choice != NONE
            and self.tool_parser is not None
            and self.tool_parser.keeps_special_tokens
        )
