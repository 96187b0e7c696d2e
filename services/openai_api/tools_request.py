"""Tool calling on the HTTP front, read into the `GenerateRequest`: OpenAI's `tools`
(functions with a JSON schema), `tool_choice` ("none", "auto", "required" or
`{"type": "function", "function": {"name": ...}}`), `parallel_tool_calls`, and the
conversation's assistant `tool_calls` and `tool` turns (each answering an earlier call by
`tool_call_id`). Shape errors are 400s naming the field here (with vLLM's wording where
vLLM has one); the gateway checks the limits and what depends on its flags. Pure."""

from __future__ import annotations

import json

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.errors import ApiError, invalid
from services.openai_api.fields import Fields, check_str, json_type

MODES = {
    "none": generate_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": generate_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": generate_pb2.TOOL_CHOICE_MODE_REQUIRED,
}
CHOICE_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def _tool(value, index: int) -> generate_pb2.Tool:
    fields = Fields(value, f"tools[{index}]")
    kind = fields.str("type") or "function"
    if kind != "function":
        raise ApiError(
            f"{fields.name('type')}: only function tools are supported, got {kind!r}",
            400,
            fields.name("type"),
            "unsupported_parameter",
        )
    function = Fields(fields.required("function"), fields.name("function"))
    fields.bool("defer_loading")  # vLLM's hint for tool search: nothing to defer here
    fields.finish()
    tool = generate_pb2.Tool(name=check_str(function.required("name"), function.name("name")))
    description = function.str("description")
    if description is not None:
        tool.description = description
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise invalid(
                function.name("parameters"),
                f"must be a JSON schema object, got {json_type(parameters)}",
                "invalid_type",
            )
        tool.parameters_json = json.dumps(parameters)
    strict = function.bool("strict")
    if strict is not None:
        tool.strict = strict
    function.bool("defer_loading")
    function.finish()
    return tool


def _choice(value, names: list[str], request: generate_pb2.GenerateRequest) -> None:
    if isinstance(value, str):
        if value not in MODES:
            raise invalid(
                "tool_choice",
                f"Invalid value for `tool_choice`: {value}! Only named tools, "
                '"none", "auto" or "required" are supported.',
            )
        if value != "none" and not names:
            raise invalid("tool_choice", "When using `tool_choice`, `tools` must be set.")
        request.tool_choice.mode = MODES[value]
        return
    fields = Fields(value, "tool_choice")
    if (fields.str("type") or "function") != "function":
        raise invalid("tool_choice.type", 'must be "function"')
    function = fields.get("function")
    if not isinstance(function, dict):
        raise invalid(
            "tool_choice.function",
            f"Invalid value for `function`: `{function}` in `tool_choice`! {CHOICE_USAGE}",
        )
    function = Fields(function, "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(
            "tool_choice.function.name",
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {CHOICE_USAGE}",
        )
    function.finish()
    fields.finish()
    if not names:
        raise invalid("tool_choice", "When using `tool_choice`, `tools` must be set.")
    if name not in names:
        raise invalid(
            "tool_choice",
            f"The tool specified in `tool_choice` ({name!r}) does not match any of the "
            f"specified `tools` ({', '.join(names)})",
        )
    request.tool_choice.function_name = name


def read_tool_list(fields: Fields, out, allow_empty: bool = False) -> list[str]:
    """`tools` into `out` (a repeated Tool field); their names. An empty array is a 400
    unless `allow_empty` (vLLM's /tokenize takes it)."""
    tools = fields.list("tools")
    if tools is not None and not tools and not allow_empty:
        raise invalid(
            "tools",
            "`tools` must not be an empty array. Either provide at least one tool or omit "
            "the field entirely.",
        )
    out.extend(_tool(tool, i) for i, tool in enumerate(tools or []))
    names = [tool.name for tool in out]
    seen = set()
    for index, name in enumerate(names):
        if name in seen:
            raise invalid(f"tools[{index}].function.name", f"{name!r} is given twice")
        seen.add(name)
    return names


def read_tools(fields: Fields, request: generate_pb2.GenerateRequest) -> None:
    """`tools`, `tool_choice` and `parallel_tool_calls` into `request`."""
    names = read_tool_list(fields, request.tools)
    choice = fields.get("tool_choice")
    if choice is not None:
        _choice(choice, names, request)
    parallel = fields.bool("parallel_tool_calls")
    if parallel is not None:
        request.parallel_tool_calls = parallel


def read_tool_calls(fields: Fields, message: generate_pb2.ChatMessage, called: set[str]) -> None:
    """An assistant turn's `tool_calls` into `message`, their ids into `called`."""
    calls = fields.list("tool_calls") or []
    for j, value in enumerate(calls):
        call = Fields(value, f"{fields.name('tool_calls')}[{j}]")
        if (call.str("type") or "function") != "function":
            raise invalid(call.name("type"), 'only "function" calls are supported')
        call_id = check_str(call.required("id"), call.name("id"))
        function = Fields(call.required("function"), call.name("function"))
        name = check_str(function.required("name"), function.name("name"))
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, str):
            arguments = json.dumps(arguments)  # an object: accepted as vLLM does
        function.finish()
        call.finish()
        message.tool_calls.add(id=call_id, name=name, arguments=arguments or "")
        called.add(call_id)


def read_tool_call_id(fields: Fields, message: generate_pb2.ChatMessage, called: set[str]):
    """A tool turn's `tool_call_id`, which must answer a call made before it."""
    call_id = check_str(fields.required("tool_call_id"), fields.name("tool_call_id"))
    if call_id not in called:
        raise invalid(
            fields.name("tool_call_id"),
            f"{call_id!r} does not answer any earlier assistant tool call",
        )
    message.tool_call_id = call_id
