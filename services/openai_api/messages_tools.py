"""Tool calling in Anthropic's Messages API, request side: `tools` (`{name, description,
input_schema}`) and `tool_choice` (`{type: "auto" | "any" | "tool" | "none", name,
disable_parallel_tool_use}`: "any" is the chat "required", "tool" a named function) -> the
chat-completions fields; a message's content blocks -> chat turns: `text` blocks are text
parts, an assistant's `tool_use` blocks its `tool_calls` (`input` as JSON arguments), its
`thinking` / `redacted_thinking` blocks passed back (accepted, not rendered: chat
templates drop earlier turns' reasoning), a user's `tool_result` blocks `tool` turns (before
the user's text, as vLLM orders them), each answering a `tool_use` made before it. Errors
name the Messages field. Pure."""

from __future__ import annotations

import json

from services.openai_api.errors import ApiError, invalid
from services.openai_api.fields import Fields, check_str, json_type

CHOICES = {"auto": "auto", "any": "required", "none": "none"}
THINKING = ("enabled", "disabled", "adaptive")
ALLOWED_BLOCKS = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
    "system": ("text",),
}


def unsupported(name: str, why: str) -> ApiError:
    return ApiError(f"{name} is not supported: {why}", 400, name, "unsupported_parameter")


def read_tool(value, index: int) -> dict:
    fields = Fields(value, f"tools[{index}]")
    kind = fields.str("type") or "custom"
    if kind != "custom":
        raise unsupported(fields.name("type"), f"server tools ({kind!r}); client tools only")
    name = check_str(fields.required("name"), fields.name("name"))
    if not name:
        raise invalid(fields.name("name"), "must not be empty")
    schema = fields.required("input_schema")
    if not isinstance(schema, dict):
        raise invalid(fields.name("input_schema"),
                      f"must be a JSON schema object, got {json_type(schema)}",
                      "invalid_type")  # fmt: skip
    if schema.get("type", "object") != "object":
        raise invalid(fields.name("input_schema.type"), 'must be "object"')
    function = {"name": name, "parameters": schema}
    description = fields.str("description")
    if description is not None:
        function["description"] = description
    strict = fields.bool("strict")
    if strict is not None:
        function["strict"] = strict
    fields.get("cache_control")  # a prompt-caching hint: the prefix cache needs none
    fields.list("input_examples")
    fields.finish()
    return {"type": "function", "function": function}


def read_tools(fields: Fields) -> dict:
    """The chat fields for `tools` and `tool_choice`."""
    tools = [read_tool(tool, i) for i, tool in enumerate(fields.list("tools") or [])]
    names = [tool["function"]["name"] for tool in tools]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise invalid(f"tools[{index}].name", f"{name!r} is given twice")
    chat: dict = {"tools": tools} if tools else {}
    value = fields.get("tool_choice")
    if value is None:
        return chat
    choice = Fields(value, "tool_choice")
    kind = check_str(choice.required("type"), choice.name("type"))
    disable_parallel = choice.bool("disable_parallel_tool_use")
    if kind == "tool":
        name = check_str(choice.required("name"), choice.name("name"))
        if name not in names:
            raise invalid("tool_choice.name", f"the tool {name!r} is not one of the `tools` "
                          f"({', '.join(names) or 'none given'})")  # fmt: skip
        chat_choice = {"type": "function", "function": {"name": name}}
    elif kind in CHOICES:
        chat_choice = CHOICES[kind]
        if kind == "any" and not names:
            raise invalid("tool_choice.type", '"any" needs `tools`')
    else:
        raise invalid("tool_choice.type", f'must be "auto", "any", "tool" or "none", got {kind!r}')
    choice.finish()
    if tools:
        chat["tool_choice"] = chat_choice
        if disable_parallel is not None:
            chat["parallel_tool_calls"] = not disable_parallel
    return chat


def read_thinking(fields: Fields) -> None:
    """`thinking`: `{"type": "enabled", "budget_tokens": n}`, `{"type": "disabled"}` or
    `{"type": "adaptive"}`, accepted; thinking blocks come from the gateway's reasoning
    parser (as in vLLM), the budget is not enforced."""
    value = fields.get("thinking")
    if value is None:
        return
    thinking = Fields(value, "thinking")
    kind = check_str(thinking.required("type"), thinking.name("type"))
    if kind not in THINKING:
        raise invalid("thinking.type", f'must be "enabled", "disabled" or "adaptive", got {kind!r}')
    budget = thinking.int("budget_tokens")
    if kind == "enabled" and budget is None:
        raise ApiError("thinking.budget_tokens is required", 400, "thinking.budget_tokens",
                       "missing_required_parameter")  # fmt: skip
    if budget is not None and budget < 1:
        raise invalid("thinking.budget_tokens", f"must be at least 1, got {budget}")
    thinking.str("display")
    thinking.finish()


def text_of_result(value, where: str) -> str:
    """A `tool_result`'s `content`: a string or text blocks (joined by newlines)."""
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise invalid(where, f"must be a string or an array of text blocks, got "
                      f"{json_type(value)}", "invalid_type")  # fmt: skip
    texts = []
    for j, block in enumerate(value):
        fields = Fields(block, f"{where}[{j}]")
        kind = check_str(fields.required("type"), fields.name("type"))
        if kind != "text":
            raise unsupported(fields.name("type"), f"{kind!r} blocks in a tool result (text only)")
        texts.append(check_str(fields.required("text"), fields.name("text")))
        fields.get("cache_control")
        fields.list("citations")
        fields.finish()
    return "\n".join(texts)


class Blocks:
    """Reads the content blocks of a conversation into chat turns, tracking the `tool_use`
    ids each `tool_result` must answer."""

    def __init__(self) -> None:
        self.called: set[str] = set()

    def text(self, fields: Fields) -> dict:
        text = check_str(fields.required("text"), fields.name("text"))
        fields.get("cache_control")
        fields.list("citations")
        fields.finish()
        return {"type": "text", "text": text}

    def tool_use(self, fields: Fields) -> dict:
        call_id = check_str(fields.required("id"), fields.name("id"))
        name = check_str(fields.required("name"), fields.name("name"))
        arguments = fields.get("input")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise invalid(fields.name("input"), f"must be an object, got {json_type(arguments)}",
                          "invalid_type")  # fmt: skip
        fields.get("cache_control")
        fields.get("caller")
        fields.finish()
        self.called.add(call_id)
        return {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip

    def tool_result(self, fields: Fields) -> dict:
        call_id = check_str(fields.required("tool_use_id"), fields.name("tool_use_id"))
        if call_id not in self.called:
            raise invalid(fields.name("tool_use_id"),
                          f"{call_id!r} answers no earlier tool_use block")  # fmt: skip
        content = text_of_result(fields.get("content"), fields.name("content"))
        fields.bool("is_error")  # accepted; the result's text says what went wrong (as vLLM)
        fields.get("cache_control")
        fields.finish()
        return {"role": "tool", "tool_call_id": call_id, "content": content}

    @staticmethod
    def thinking(fields: Fields, kind: str) -> None:
        if kind == "thinking":
            check_str(fields.required("thinking"), fields.name("thinking"))
            fields.str("signature")
        else:
            fields.str("data")
        fields.finish()

    def message(self, role: str, blocks: list, where: str) -> list[dict]:
        """One message's blocks -> its chat turns: `tool` turns first, then the message."""
        parts, calls, results = [], [], []
        for j, value in enumerate(blocks):
            fields = Fields(value, f"{where}[{j}]")
            kind = check_str(fields.required("type"), fields.name("type"))
            allowed = ALLOWED_BLOCKS[role]
            if kind not in allowed:
                why = f"{kind!r} blocks in {role} content ({', '.join(allowed)})"
                raise unsupported(fields.name("type"), why)
            if kind == "text":
                parts.append(self.text(fields))
            elif kind == "tool_use":
                calls.append(self.tool_use(fields))
            elif kind == "tool_result":
                results.append(self.tool_result(fields))
            else:
                self.thinking(fields, kind)
        turns = list(results)
        if calls:
            turns.append({"role": role, "content": parts or None, "tool_calls": calls})
        elif parts or not results:
            turns.append({"role": role, "content": parts})
        return turns
