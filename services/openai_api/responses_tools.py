"""Tool calling in the Responses API, request side: function `tools` in Responses' flat shape
(`{type: "function", name, description, parameters, strict}`) and `tool_choice` ("none",
"auto", "required", `{type: "function", name}`) -> the chat-completions fields; the input
items `function_call` (-> an assistant turn's `tool_calls`, merged into the assistant turn
before it, as vLLM merges them), `function_call_output` (-> a `tool` turn, which must answer
a call made before it, in the input or in the stored conversation) and `reasoning` (passed
back: accepted, not rendered — chat templates drop earlier turns' reasoning). Errors name
the Responses field. Pure."""

from __future__ import annotations

from services.openai_api.errors import ApiError, invalid
from services.openai_api.fields import Fields, check_str, json_type

CHOICE_MODES = ("none", "auto", "required")


def unsupported(name: str, why: str) -> ApiError:
    return ApiError(f"{name} is not supported: {why}", 400, name, "unsupported_parameter")


def read_tool(value, index: int) -> tuple[dict, dict]:
    """One function tool -> (the chat tool, the tool as the response echoes it)."""
    fields = Fields(value, f"tools[{index}]")
    kind = check_str(fields.required("type"), fields.name("type"))
    if kind != "function":
        raise unsupported(fields.name("type"), f"tools of type {kind!r} (function tools only)")
    name = check_str(fields.required("name"), fields.name("name"))
    if not name:
        raise invalid(fields.name("name"), "must not be empty")
    parameters = fields.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid(fields.name("parameters"),
                      f"must be a JSON schema object, got {json_type(parameters)}",
                      "invalid_type")  # fmt: skip
    description = fields.str("description")
    strict = fields.bool("strict")
    fields.bool("defer_loading")
    fields.finish()
    function = {"name": name, "description": description, "parameters": parameters,
                "strict": strict}  # fmt: skip
    chat = {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}
    return chat, {"type": "function", **function}


def read_choice(value, names: list[str]):
    """`tool_choice` -> the chat `tool_choice`."""
    if isinstance(value, str):
        if value not in CHOICE_MODES:
            raise invalid("tool_choice", f'must be "none", "auto", "required" or '
                          f'{{"type": "function", "name": ...}}, got {value!r}')  # fmt: skip
        if value == "required" and not names:
            raise invalid("tool_choice", '"required" needs `tools`')
        return value
    fields = Fields(value, "tool_choice")
    kind = check_str(fields.required("type"), fields.name("type"))
    if kind != "function":
        raise unsupported("tool_choice.type", f"{kind!r} (function choices only)")
    name = check_str(fields.required("name"), fields.name("name"))
    fields.finish()
    if name not in names:
        raise invalid("tool_choice", f"the function {name!r} is not one of the `tools` "
                      f"({', '.join(names) or 'none given'})")  # fmt: skip
    return {"type": "function", "function": {"name": name}}


def read_tools(fields: Fields, echo: dict) -> dict:
    """The chat fields for `tools`, `tool_choice`, `parallel_tool_calls`; what the response
    echoes of them."""
    pairs = [read_tool(tool, i) for i, tool in enumerate(fields.list("tools") or [])]
    names = [chat["function"]["name"] for chat, _ in pairs]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise invalid(f"tools[{index}].name", f"{name!r} is given twice")
    choice = fields.get("tool_choice")
    chat: dict = {}
    if pairs:
        chat["tools"] = [c for c, _ in pairs]
    if choice is not None:
        chat_choice = read_choice(choice, names)
        if pairs:
            chat["tool_choice"] = chat_choice
    parallel = fields.bool("parallel_tool_calls")
    if parallel is not None and pairs:
        chat["parallel_tool_calls"] = parallel
    echo.update(tools=[e for _, e in pairs], tool_choice=choice or "auto",
                parallel_tool_calls=True if parallel is None else parallel)  # fmt: skip
    return chat


def output_text_of(value, where: str) -> str:
    """A `function_call_output`'s `output`: a string or `input_text` parts (joined)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(where, f"must be a string or an array of input_text parts, got "
                      f"{json_type(value)}", "invalid_type")  # fmt: skip
    texts = []
    for j, part in enumerate(value):
        fields = Fields(part, f"{where}[{j}]")
        kind = check_str(fields.required("type"), fields.name("type"))
        if kind != "input_text":
            raise unsupported(fields.name("type"), f"output parts of type {kind!r} (text only)")
        texts.append(check_str(fields.required("text"), fields.name("text")))
        fields.finish()
    return "".join(texts)


class ToolItems:
    """Reads the tool items of one `input` into chat messages, tracking the calls made: a
    `function_call_output` must answer one (here or, `unmatched`, in the stored history)."""

    def __init__(self) -> None:
        self.called: set[str] = set()
        self.unmatched: list[tuple[int, str]] = []  # (item index, call_id) not called here

    def function_call(self, fields: Fields, messages: list[dict]) -> None:
        call_id = check_str(fields.required("call_id"), fields.name("call_id"))
        name = check_str(fields.required("name"), fields.name("name"))
        arguments = check_str(fields.required("arguments"), fields.name("arguments"))
        for key in ("id", "status", "namespace"):
            fields.str(key)
        fields.finish()
        call = {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}  # fmt: skip
        self.called.add(call_id)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            return
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})

    def function_call_output(self, fields: Fields, index: int) -> dict:
        call_id = check_str(fields.required("call_id"), fields.name("call_id"))
        output = output_text_of(fields.required("output"), fields.name("output"))
        fields.str("id")
        fields.str("status")
        fields.finish()
        if call_id not in self.called:
            self.unmatched.append((index, call_id))
        return {"role": "tool", "tool_call_id": call_id, "content": output}

    @staticmethod
    def reasoning(fields: Fields) -> None:
        """A reasoning item passed back: read, not rendered."""
        for key in ("id", "status", "encrypted_content"):
            fields.str(key)
        for key in ("summary", "content"):
            fields.list(key)
        if fields.get("encrypted_content") is not None:
            raise unsupported(fields.name("encrypted_content"), "no encrypted reasoning")
        fields.finish()


def check_answers(unmatched: list[tuple[int, str]], history) -> None:
    """Each `function_call_output` not answering a call of its input must answer one of
    the stored conversation (`previous_response_id`)."""
    called = {call["id"] for message in history for call in message.get("tool_calls") or ()}
    for index, call_id in unmatched:
        if call_id not in called:
            raise invalid(f"input[{index}].call_id",
                          f"no function_call with call_id {call_id!r} before this output "
                          "(in the input or the previous response)")  # fmt: skip


def assistant_turn(output: list[dict]) -> dict:
    """A response's output items as the assistant chat turn the store keeps (text and
    calls; reasoning left out, as chat templates leave it out of earlier turns)."""
    texts = [part.get("text", "") for item in output if item["type"] == "message"
             for part in item["content"]]  # fmt: skip
    calls = [
        {"id": item["call_id"], "type": "function",
         "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output if item["type"] == "function_call"
    ]  # fmt: skip
    turn: dict = {"role": "assistant", "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
        turn["content"] = turn["content"] or None
    return turn
