"""`POST /v1/responses` JSON body -> `ResponsesRequest`: the conversation as
chat-completions messages, the sampling fields under their chat-completions names, and what
the answer echoes back. `chat_body(history)` is then the very body `/v1/chat/completions`
would get (instructions as the system message, the stored history of
`previous_response_id`, the new input), read by `parse_chat` into the same `ChatRequest`,
so both endpoints run one path. Errors name the Responses field. Pure.

Tools (`responses_tools.py`): function `tools`, `tool_choice`, `parallel_tool_calls` and the
`function_call` / `function_call_output` / `reasoning` input items become the chat fields,
assistant `tool_calls` and `tool` turns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.openai_api.errors import ApiError, invalid
from services.openai_api.fields import Fields, check_str, json_type
from services.openai_api.responses_tools import ToolItems, check_answers, read_tools

INPUT_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
REASONING_KEYS = ("effort", "summary", "generate_summary")
# Sampling and vLLM extras passed to the chat body under the same name (vLLM's
# ResponsesRequest takes these too).
CHAT_NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty")  # fmt: skip
CHAT_PASSTHROUGH = ("top_k", "seed", "logit_bias", "cache_salt", "skip_special_tokens",
                    "include_stop_str_in_output")  # fmt: skip


# Fields accepted only at the values this server implements: (accepted, why not others).
FIXED = {
    "background": ((None, False), "only false (no background responses)"),
    "truncation": ((None, "disabled"), 'only "disabled"'),
    "top_logprobs": ((None, 0), "only 0 (no logprobs)"),
    "max_tool_calls": ((None,), "no limit on tool calls"),
    "prompt": ((None,), "no stored prompts"),
    "conversation": ((None,), "no conversations; use previous_response_id"),
}


@dataclass(frozen=True)
class ResponsesRequest:
    model: str | None
    input_messages: list[dict]
    instructions: str | None
    previous_response_id: str | None
    store: bool
    stream: bool
    chat_fields: dict
    # What the response object echoes (OpenAI's names), beyond the above.
    echo: dict = field(default_factory=dict)
    # (item index, call_id) of function_call_outputs whose call is not in the input.
    unmatched: list[tuple[int, str]] = field(default_factory=list)

    def chat_body(self, history: Sequence[dict] = ()) -> dict:
        """The `/v1/chat/completions` body of this request after `history` (the messages a
        `previous_response_id` stored)."""
        check_answers(self.unmatched, history)
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return {"messages": [*system, *history, *self.input_messages], **self.chat_fields}


def unsupported(name: str, why: str) -> ApiError:
    return ApiError(f"{name} is not supported: {why}", 400, name, "unsupported_parameter")


def read_parts(value, where: str, role: str) -> list[dict]:
    """Content parts -> chat text parts. `input_text` (and `output_text` / `refusal` on
    assistant turns, as `response.output` items passed back carry them)."""
    parts = []
    for j, part in enumerate(value):
        fields = Fields(part, f"{where}[{j}]")
        kind = check_str(fields.required("type"), fields.name("type"))
        if kind in TEXT_PARTS:
            text = check_str(fields.required("text"), fields.name("text"))
            fields.get("annotations")  # output_text's, as passed back: nothing to render
            fields.get("logprobs")
        elif kind == "refusal" and role == "assistant":
            text = check_str(fields.required("refusal"), fields.name("refusal"))
        else:
            raise unsupported(fields.name("type"), f"content parts of type {kind!r} (text only)")
        fields.finish()
        parts.append({"type": "text", "text": text})
    return parts


def read_item(value, index: int, messages: list[dict], tools: ToolItems) -> None:
    """One `input` item into `messages`: an easy message (`{role, content}`), an input
    message or an output message passed back (`type: "message"`, with its `id`, `status`),
    or a tool item (`function_call`, `function_call_output`, `reasoning`)."""
    fields = Fields(value, f"input[{index}]")
    kind = fields.str("type") or "message"
    if kind == "function_call":
        return tools.function_call(fields, messages)
    if kind == "function_call_output":
        return messages.append(tools.function_call_output(fields, index))
    if kind == "reasoning":
        return tools.reasoning(fields)
    if kind != "message":
        raise unsupported(fields.name("type"), f"input items of type {kind!r}")
    role = check_str(fields.required("role"), fields.name("role"))
    if role not in INPUT_ROLES:
        raise invalid(fields.name("role"), f"must be one of {', '.join(INPUT_ROLES)}")
    content = fields.required("content")
    if isinstance(content, list):
        content = read_parts(content, fields.name("content"), role)
    elif not isinstance(content, str):
        raise invalid(
            fields.name("content"),
            f"must be a string or an array of content parts, got {json_type(content)}",
            "invalid_type",
        )
    fields.str("id")
    fields.str("status")
    fields.str("phase")
    fields.finish()
    messages.append({"role": role, "content": content})


def read_input(value, tools: ToolItems) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input", "must be a string or a non-empty array of input items",
                      "invalid_type")  # fmt: skip
    messages: list[dict] = []
    for i, item in enumerate(value):
        read_item(item, i, messages, tools)
    if not messages:
        raise invalid("input", "has no message, function call or function call output")
    return messages


def read_reasoning(fields: Fields, echo: dict) -> None:
    """`reasoning` (`effort`, `summary`): accepted and echoed; the reasoning output is the
    gateway's reasoning parser's, as in vLLM."""
    value = fields.get("reasoning")
    echo["reasoning"] = value
    if value is not None:
        reasoning = Fields(value, "reasoning")
        for key in REASONING_KEYS:
            reasoning.str(key)
        reasoning.finish()


def read_text_format(fields: Fields, echo: dict) -> dict:
    """`text.format` -> the chat `response_format` (text, json_object, json_schema)."""
    value = fields.get("text")
    echo["text"] = value
    if value is None:
        return {}
    text = Fields(value, "text")
    text.get("verbosity")
    form = text.get("format")
    text.finish()
    if form is None:
        return {}
    spec = Fields(form, "text.format")
    kind = check_str(spec.required("type"), spec.name("type"))
    if kind == "text":
        spec.finish()
        return {}
    if kind == "json_object":
        spec.finish()
        return {"response_format": {"type": "json_object"}}
    if kind != "json_schema":
        raise unsupported("text.format.type", f"{kind!r} (text, json_object, json_schema)")
    schema = spec.required("schema")
    if not isinstance(schema, dict):
        raise invalid("text.format.schema", "must be a JSON object", "invalid_type")
    json_schema = {"name": spec.str("name") or "response", "schema": schema}
    spec.str("description")
    strict = spec.bool("strict")
    if strict is not None:
        json_schema["strict"] = strict
    spec.finish()
    return {"response_format": {"type": "json_schema", "json_schema": json_schema}}


def read_fixed(fields: Fields, echo: dict) -> None:
    """Fields accepted only at the value this server implements, echoed back."""
    for key, (allowed, why) in FIXED.items():
        if fields.get(key) not in allowed:
            raise unsupported(key, why)
    echo["top_logprobs"] = fields.get("top_logprobs")  # None or 0, as given (as vLLM)
    include = fields.list("include")
    if include:
        raise unsupported("include", "no extra output data")
    service_tier = fields.str("service_tier")
    metadata = fields.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise invalid("metadata", "must be an object of string values", "invalid_type")
    echo.update(
        background=False,
        truncation="disabled",
        max_tool_calls=None,
        prompt=None,
        service_tier=service_tier or "auto",
        metadata=metadata,
        user=fields.str("user"),
    )


def read_sampling(fields: Fields, echo: dict) -> dict:
    chat: dict = {}
    for key in CHAT_NUMBERS:
        value = fields.number(key)
        if value is not None:
            chat[key] = value
    for key in CHAT_PASSTHROUGH:
        value = fields.get(key)
        if value is not None:
            chat[key] = value  # parse_chat checks these, under the same name
    max_output = fields.int("max_output_tokens")
    if max_output is not None:
        if max_output < 1:
            raise invalid("max_output_tokens", f"must be at least 1, got {max_output}")
        chat["max_completion_tokens"] = max_output
    echo.update(
        temperature=chat.get("temperature", 1.0),
        top_p=chat.get("top_p", 1.0),
        presence_penalty=chat.get("presence_penalty", 0.0),
        frequency_penalty=chat.get("frequency_penalty", 0.0),
        max_output_tokens=max_output,
    )
    return chat


def parse_responses(body) -> ResponsesRequest:
    fields = Fields(body)
    tools = ToolItems()
    input_messages = read_input(fields.required("input"), tools)
    instructions = fields.str("instructions")
    previous = fields.str("previous_response_id")
    store = fields.bool("store")
    echo: dict = {"instructions": instructions, "previous_response_id": previous}
    chat = {
        **read_sampling(fields, echo),
        **read_text_format(fields, echo),
        **read_tools(fields, echo),
    }
    read_fixed(fields, echo)
    read_reasoning(fields, echo)
    stream = bool(fields.bool("stream"))
    options = fields.get("stream_options")
    if options is not None:
        if not stream:
            raise ApiError("stream_options is only allowed with stream=true", 400,
                           "stream_options")  # fmt: skip
        stream_options = Fields(options, "stream_options")
        stream_options.bool("include_obfuscation")  # accepted; nothing is obfuscated
        stream_options.finish()
    model = fields.str("model")
    fields.finish()
    return ResponsesRequest(
        model=model,
        input_messages=input_messages,
        instructions=instructions,
        previous_response_id=previous,
        store=True if store is None else store,
        stream=stream,
        chat_fields=chat,
        echo=echo,
        unmatched=tools.unmatched,
    )
