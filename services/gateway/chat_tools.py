"""A request's tools, checked: `tools`, `tool_choice` and `parallel_tool_calls` against
their limits (docs/api.md, Tool calling), the functions as the chat template gets them,
the conversation's tool calls and tool results (every result answers an earlier call),
and the JSON schema that forces calls for tool_choice `required` or a named function.
Errors are InvalidArgumentError naming the field. Pure: no grpc, no tokenizer."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from common.json_depth import load_json
from common.pb.tandem.v1 import generate_pb2
from services.gateway.structured_check import MAX_SCHEMA_DEPTH, MAX_TEXT_BYTES
from services.gateway.tool_parsers.forced import parameters_or_empty, required_schema
from services.gateway.validation import InvalidArgumentError

MAX_TOOLS = 128
MAX_DESCRIPTION_CHARS = 16384
MAX_TOOL_CALLS = 128
MAX_TOOL_CALL_ID_CHARS = 256
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
JSON_TYPES = frozenset(("object", "array", "string", "number", "integer", "boolean", "null"))
NONE, AUTO, REQUIRED, FUNCTION = "none", "auto", "required", "function"
MODES = {
    generate_pb2.TOOL_CHOICE_MODE_NONE: NONE,
    generate_pb2.TOOL_CHOICE_MODE_AUTO: AUTO,
    generate_pb2.TOOL_CHOICE_MODE_REQUIRED: REQUIRED,
}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict | None
    strict: bool | None

    def for_template(self) -> dict:
        """As vLLM hands a tool to the chat template (unset fields as None, but `strict`
        only when given)."""
        function = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
        }
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """The tools of one request and what it asks of them."""

    functions: tuple[Function, ...]
    choice: str  # none, auto, required or function
    function: str | None = None  # the named function (choice "function")
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in (REQUIRED, FUNCTION)

    def template_tools(self) -> list[dict] | None:
        return [f.for_template() for f in self.functions] or None

    def forced_schema(self) -> str:
        """The JSON schema (text) the output must follow when a call is forced."""
        if self.choice == FUNCTION:
            chosen = next(f for f in self.functions if f.name == self.function)
            return json.dumps(parameters_or_empty(chosen.parameters))
        tools = [(f.name, f.parameters) for f in self.functions]
        return json.dumps(required_schema(tools, self.parallel))


def _check_schema(value, field: str, depth: int = 0) -> None:
    """The parts of a JSON schema any tool schema must get right (types, properties,
    required); xgrammar checks the rest when it compiles a forced call."""
    if not isinstance(value, dict):
        if isinstance(value, bool) and depth:
            return  # true / false are schemas below the top
        raise InvalidArgumentError(f"{field} must be a JSON schema object")
    kind = value.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
        raise InvalidArgumentError(
            f"{field}.type must be one of {', '.join(sorted(JSON_TYPES))}, got {kind!r}"
        )
    properties = value.get("properties", {})
    if not isinstance(properties, dict):
        raise InvalidArgumentError(f"{field}.properties must be an object of schemas")
    for name, schema in properties.items():
        _check_schema(schema, f"{field}.properties.{name}", depth + 1)
    required = value.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise InvalidArgumentError(f"{field}.required must be an array of property names")
    if "items" in value:
        _check_schema(value["items"], f"{field}.items", depth + 1)


def _function(tool: generate_pb2.Tool, field: str) -> Function:
    if not TOOL_NAME.fullmatch(tool.name):
        raise InvalidArgumentError(
            f"{field}.name must be 1..64 letters, digits, '_' or '-', got {tool.name!r}"
        )
    if len(tool.description) > MAX_DESCRIPTION_CHARS:
        raise InvalidArgumentError(
            f"{field}.description must be at most {MAX_DESCRIPTION_CHARS} characters"
        )
    parameters = None
    if tool.HasField("parameters_json"):
        where, text = f"{field}.parameters_json", tool.parameters_json
        limit = MAX_TEXT_BYTES["json_schema"]
        if len(text.encode("utf-8", errors="surrogatepass")) > limit:
            raise InvalidArgumentError(
                f"{where} must be a JSON schema object of at most {limit} bytes"
            )
        try:
            parameters = load_json(text, MAX_SCHEMA_DEPTH, where)
        except ValueError as exc:
            raise InvalidArgumentError(f"{where} must be a JSON schema object: {exc}") from None
        _check_schema(parameters, where)
    return Function(
        tool.name,
        tool.description if tool.HasField("description") else None,
        parameters,
        tool.strict if tool.HasField("strict") else None,
    )


def validate_functions(tools) -> tuple[Function, ...]:
    """The functions of a `tools` field, checked."""
    if len(tools) > MAX_TOOLS:
        raise InvalidArgumentError(f"tools must hold at most {MAX_TOOLS} tools, got {len(tools)}")
    functions, names = [], set()
    for index, tool in enumerate(tools):
        function = _function(tool, f"tools[{index}]")
        if function.name in names:
            raise InvalidArgumentError(f"tools[{index}].name {function.name!r} is given twice")
        names.add(function.name)
        functions.append(function)
    return tuple(functions)


def validate_tools(request: generate_pb2.GenerateRequest) -> ToolRequest | None:
    """The request's tools and tool choice (None: no tools, no choice but none)."""
    functions = validate_functions(request.tools)
    names = {f.name for f in functions}
    which = request.tool_choice.WhichOneof("choice")
    name = request.tool_choice.function_name if which == "function_name" else None
    if which == "function_name":
        choice = FUNCTION
    elif which == "mode" and request.tool_choice.mode in MODES:
        choice = MODES[request.tool_choice.mode]
    else:
        choice = AUTO if functions else NONE
    if not functions and choice != NONE:
        raise InvalidArgumentError(f"tool_choice {name or choice!r} needs tools")
    if name is not None and name not in names:
        raise InvalidArgumentError(
            f"tool_choice.function_name {name!r} is not one of tools: {', '.join(sorted(names))}"
        )
    if functions and request.WhichOneof("prompt") != "chat":
        raise InvalidArgumentError("tools need prompt.chat (the chat template renders them)")
    if choice == FUNCTION and request.HasField("structured_output"):
        raise InvalidArgumentError(
            "structured_output cannot be combined with a named tool_choice (set one of them)"
        )
    if not functions:
        return None
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    return ToolRequest(functions, choice, name, parallel)


def _arguments(text: str):
    """A past call's arguments as templates want them: an object (vLLM's coercion: text
    that is not a JSON object becomes {})."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def template_messages(
    chat: generate_pb2.ChatMessages, messages: list[dict], field: str, answers: bool = True
):
    """`messages` (role and content, already checked) with each assistant turn's calls and
    each tool turn's call id, as chat templates take them; with `answers`, every tool turn
    must answer a call made before it (Tokenize renders any conversation, as vLLM's)."""
    called: set[str] = set()
    for index, (message, out) in enumerate(zip(chat.messages, messages, strict=True)):
        where = f"{field}.messages[{index}]"
        if message.tool_calls and message.role != "assistant":
            raise InvalidArgumentError(f"{where}.tool_calls are only allowed on assistant turns")
        if len(message.tool_calls) > MAX_TOOL_CALLS:
            raise InvalidArgumentError(f"{where}.tool_calls must hold at most {MAX_TOOL_CALLS}")
        calls = []
        for j, call in enumerate(message.tool_calls):
            if not 1 <= len(call.id) <= MAX_TOOL_CALL_ID_CHARS:
                raise InvalidArgumentError(
                    f"{where}.tool_calls[{j}].id must be 1..{MAX_TOOL_CALL_ID_CHARS} characters"
                )
            if not call.name:
                raise InvalidArgumentError(f"{where}.tool_calls[{j}].name must not be empty")
            called.add(call.id)
            function = {"name": call.name, "arguments": _arguments(call.arguments)}
            calls.append({"id": call.id, "type": "function", "function": function})
        if calls:
            out["tool_calls"] = calls
        if message.role == "tool":
            if answers and message.tool_call_id not in called:
                raise InvalidArgumentError(
                    f"{where}.tool_call_id {message.tool_call_id!r} does not answer an "
                    "earlier assistant tool call"
                )
            if message.tool_call_id:
                out["tool_call_id"] = message.tool_call_id
        elif message.tool_call_id:
            raise InvalidArgumentError(f"{where}.tool_call_id is only allowed on tool turns")
    return messages
