"""Anthropic's `POST /v1/messages` JSON body -> `MessagesRequest`: the chat-completions
body it means (`system` as the system message, `messages` with text blocks as text parts,
`max_tokens`, `stop_sequences` as `stop`, `temperature`, `top_p`, `top_k`), which
`parse_chat` reads into the same `ChatRequest` as `/v1/chat/completions`. `model` and
`max_tokens` are required, as Anthropic requires them. A last `assistant` turn is a
prefill the answer continues (vLLM's `continue_final_message`), as in Anthropic's API.
Errors name the Messages field. Pure.

Tools, `tool_use` / `tool_result` / `thinking` blocks and the `thinking` setting are read
by `messages_tools.py`."""

from __future__ import annotations

from dataclasses import dataclass

from services.openai_api.errors import ApiError, invalid
from services.openai_api.fields import Fields, check_str, json_type
from services.openai_api.messages_tools import Blocks, read_thinking, read_tools

ROLES = ("user", "assistant")
# vLLM's extras on this endpoint, passed to the chat body under the same name, and
# `logit_bias` (Tandem's: as on chat completions; vLLM's Messages API ignores it).
PASSTHROUGH = ("cache_salt", "min_p", "repetition_penalty", "seed", "logit_bias")


@dataclass(frozen=True)
class MessagesRequest:
    model: str
    stream: bool
    chat: dict  # the /v1/chat/completions body


def unsupported(name: str, why: str) -> ApiError:
    return ApiError(f"{name} is not supported: {why}", 400, name, "unsupported_parameter")


def read_message(value, index: int, blocks: Blocks) -> list[dict]:
    """One message -> its chat turns (tool results become `tool` turns before it)."""
    fields = Fields(value, f"messages[{index}]")
    role = check_str(fields.required("role"), fields.name("role"))
    if role not in ROLES:
        raise invalid(fields.name("role"), f'must be "user" or "assistant", got {role!r}')
    content = fields.required("content")
    fields.finish()
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(fields.name("content"), f"must be a string or an array of content "
                      f"blocks, got {json_type(content)}", "invalid_type")  # fmt: skip
    return blocks.message(role, content, fields.name("content"))


def read_system(value) -> str | None:
    """`system`: a string, or text blocks joined as they are (as vLLM joins them)."""
    if value is None or isinstance(value, str):
        return value or None
    if not isinstance(value, list):
        raise invalid("system", f"must be a string or an array of text blocks, got "
                      f"{json_type(value)}", "invalid_type")  # fmt: skip
    parts = Blocks().message("system", value, "system")[0]["content"]
    return "".join(part["text"] for part in parts) or None


def read_metadata(fields: Fields) -> None:
    value = fields.get("metadata")
    if value is not None:
        metadata = Fields(value, "metadata")
        metadata.str("user_id")  # accepted and ignored, as `user` on the OpenAI endpoints
        metadata.finish()


def parse_messages(body) -> MessagesRequest:
    fields = Fields(body)
    model = check_str(fields.required("model"), "model")
    max_tokens = fields.int("max_tokens")
    if max_tokens is None:
        raise ApiError("max_tokens is required", 400, "max_tokens", "missing_required_parameter")
    if max_tokens < 1:
        raise invalid("max_tokens", f"must be at least 1, got {max_tokens}")
    value = fields.required("messages")
    if not isinstance(value, list) or not value:
        raise invalid("messages", "must be a non-empty array of {role, content}", "invalid_type")
    blocks = Blocks()
    messages = [turn for i, m in enumerate(value) for turn in read_message(m, i, blocks)]
    system = read_system(fields.get("system"))
    chat: dict = {
        "messages": ([{"role": "system", "content": system}] if system else []) + messages,
        "max_completion_tokens": max_tokens,
    }
    if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        # Anthropic's prefill: the answer continues the last assistant turn.
        chat.update(add_generation_prompt=False, continue_final_message=True)
    stops = fields.list("stop_sequences")
    if stops:
        chat["stop"] = [check_str(s, f"stop_sequences[{i}]") for i, s in enumerate(stops)]
    for key in ("temperature", "top_p"):
        number = fields.number(key)
        if number is not None:
            chat[key] = number
    top_k = fields.int("top_k")
    if top_k is not None:
        chat["top_k"] = top_k
    for key in PASSTHROUGH:
        if fields.get(key) is not None:
            chat[key] = fields.get(key)  # parse_chat checks it, under the same name
    chat.update(read_tools(fields))
    read_thinking(fields)
    read_metadata(fields)
    fields.str("service_tier")  # accepted; one tier here
    fields.get("cache_control")  # a prompt-caching hint: the prefix cache needs none
    stream = bool(fields.bool("stream"))
    fields.finish()
    return MessagesRequest(model, stream, chat)
