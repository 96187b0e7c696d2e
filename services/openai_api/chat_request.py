"""`/v1/chat/completions` JSON body -> one `GenerateRequest` with chat messages (the gateway
renders the checkpoint's chat template, with `add_generation_prompt` and vLLM's
`continue_final_message`). Text content only; tools, tool calls and tool turns are read by
`tools_request.py`; the legacy `functions` / `function_call` are refused by name. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.errors import ApiError, invalid
from services.openai_api.fields import Fields, check_str, json_type
from services.openai_api.params import Options, read_common, read_max_tokens, unsupported
from services.openai_api.tools_request import read_tool_call_id, read_tool_calls, read_tools

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True)
class ChatRequest:
    options: Options
    request: generate_pb2.GenerateRequest
    logprobs: bool
    top_logprobs: int


def read_content(value, where: str) -> str:
    """A string, or text parts (`[{"type": "text", "text": ...}]`) joined by newlines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(
            where,
            f"must be a string or an array of text parts, got {json_type(value)}",
            "invalid_type",
        )
    texts = []
    for j, part in enumerate(value):
        fields = Fields(part, f"{where}[{j}]")
        kind = check_str(fields.required("type"), fields.name("type"))
        if kind != "text":
            raise ApiError(
                f"{fields.name('type')}: content parts of type {kind!r} are not supported "
                "(text only)",
                400,
                fields.name("type"),
                "unsupported_parameter",
            )
        texts.append(check_str(fields.required("text"), fields.name("text")))
        fields.finish()
    return "\n".join(texts)


ROLE_ALIASES = {"developer": "system"}


def read_message(value, index: int, called: set[str]) -> generate_pb2.ChatMessage:
    """One turn; `called`: the tool call ids of the turns before it (this one's added)."""
    fields = Fields(value, f"messages[{index}]")
    role = check_str(fields.required("role"), fields.name("role"))
    # OpenAI's newer clients call the system turn "developer"; chat templates know "system".
    message = generate_pb2.ChatMessage(role=ROLE_ALIASES.get(role, role))
    if role == "assistant":
        read_tool_calls(fields, message, called)
    elif role == "tool":
        read_tool_call_id(fields, message, called)
    # An assistant turn that only calls tools may have no content (null or absent).
    if message.tool_calls:
        content = fields.get("content")
        message.content = "" if content is None else read_content(content, fields.name("content"))
    else:
        message.content = read_content(fields.required("content"), fields.name("content"))
    fields.str("name")  # a participant's name: accepted, not shown to the model (as vLLM)
    fields.finish()
    return message


def read_messages(value) -> list[generate_pb2.ChatMessage]:
    if not isinstance(value, list) or not value:
        raise invalid("messages", "must be a non-empty array of {role, content}", "invalid_type")
    called: set[str] = set()
    return [read_message(m, i, called) for i, m in enumerate(value)]


def read_chat_options(fields: Fields, chat: generate_pb2.ChatMessages) -> None:
    """`add_generation_prompt` (unset: the gateway's default, true unless continuing) and
    `continue_final_message`; both true is a 400, as in vLLM."""
    add_generation_prompt = fields.bool("add_generation_prompt")
    continue_final = bool(fields.bool("continue_final_message"))
    if add_generation_prompt and continue_final:
        raise ApiError(
            "continue_final_message: cannot be true with add_generation_prompt=true "
            "(set add_generation_prompt to false)",
            400,
            "continue_final_message",
        )
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    chat.continue_final_message = continue_final


def refuse_functions(fields: Fields) -> None:
    """OpenAI's deprecated `functions` / `function_call` (vLLM has none either)."""
    unsupported(fields, "functions", "use tools and tool_choice")
    unsupported(fields, "function_call", "use tools and tool_choice")


def parse_chat(body) -> ChatRequest:
    fields = Fields(body)
    messages = read_messages(fields.required("messages"))
    request = generate_pb2.GenerateRequest()
    request.chat.messages.extend(messages)
    read_chat_options(fields, request.chat)
    options = read_common(fields, request)
    # max_completion_tokens replaces the deprecated max_tokens; unset = until the context ends.
    read_max_tokens(fields, "max_tokens", request)
    read_max_tokens(fields, "max_completion_tokens", request)
    logprobs = bool(fields.bool("logprobs"))
    top_logprobs = fields.int("top_logprobs")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
    if top_logprobs is not None and not logprobs:
        raise ApiError("top_logprobs requires logprobs=true", 400, "top_logprobs")
    if logprobs:
        request.logprobs = top_logprobs or 0
    read_tools(fields, request)
    refuse_functions(fields)
    fields.finish()
    return ChatRequest(options, request, logprobs, top_logprobs or 0)
