"""vLLM's `/tokenize` and `/detokenize` bodies -> the gateway's `TokenizeRequest` and token
ids, and their answers. Pure.

`/tokenize` has vLLM's two forms: completion (`prompt`, a string; `add_special_tokens`
default true) and chat (`messages` read as `/v1/chat/completions` reads them, rendered by
the gateway's one chat template path, with chat's `add_generation_prompt` (default true) and
`continue_final_message`; `add_special_tokens` default false). Both take
`return_token_strs` (each token's piece). What the chat template path does not do is
refused by name: `add_special_tokens: true` with messages, non-empty
`chat_template_kwargs`, and `tools` (as chat refuses them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.chat_request import read_chat_options, read_messages
from services.openai_api.errors import ApiError, invalid
from services.openai_api.fields import INT64, Fields, check_int, json_type
from services.openai_api.tools_request import read_tool_list


@dataclass(frozen=True)
class TokenizeCall:
    model: str | None
    request: generate_pb2.TokenizeRequest
    return_token_strs: bool


@dataclass(frozen=True)
class DetokenizeCall:
    model: str | None
    tokens: tuple[int, ...]


def _unsupported_value(key: str, why: str) -> ApiError:
    return ApiError(f"{key}: {why}", 400, key, "unsupported_parameter")


def _read_chat(fields: Fields, request: generate_pb2.TokenizeRequest) -> None:
    request.chat.messages.extend(read_messages(fields.get("messages")))
    read_chat_options(fields, request.chat)
    if fields.bool("add_special_tokens"):
        raise _unsupported_value(
            "add_special_tokens",
            "true is not supported with messages (the chat template places the special tokens)",
        )
    kwargs = fields.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise invalid(
            "chat_template_kwargs", f"must be an object, got {json_type(kwargs)}", "invalid_type"
        )
    if kwargs:
        raise _unsupported_value("chat_template_kwargs", "template arguments are not supported")
    read_tool_list(fields, request.tools, allow_empty=True)


def parse_tokenize(body) -> TokenizeCall:
    fields = Fields(body)
    model = fields.str("model")
    return_token_strs = bool(fields.bool("return_token_strs"))
    request = generate_pb2.TokenizeRequest()
    has_prompt, has_messages = not fields.missing("prompt"), not fields.missing("messages")
    if has_prompt and has_messages:
        raise ApiError("set either prompt or messages, not both", 400, "messages")
    if has_messages:
        _read_chat(fields, request)
    else:
        prompt = fields.required("prompt")
        if not isinstance(prompt, str):
            raise invalid("prompt", f"must be a string, got {json_type(prompt)}", "invalid_type")
        request.text = prompt
        add_special_tokens = fields.bool("add_special_tokens")
        request.add_special_tokens = True if add_special_tokens is None else add_special_tokens
    fields.finish()
    return TokenizeCall(model, request, return_token_strs)


def tokenize_body(reply: generate_pb2.TokenizeResponse, return_token_strs: bool) -> dict:
    return {
        "count": len(reply.token_ids),
        "max_model_len": reply.max_model_len,
        "tokens": list(reply.token_ids),
        "token_strs": list(reply.tokens) if return_token_strs else None,
    }


def parse_detokenize(body) -> DetokenizeCall:
    fields = Fields(body)
    model = fields.str("model")
    tokens = fields.list("tokens")
    if tokens is None:
        raise ApiError("tokens is required", 400, "tokens", "missing_required_parameter")
    ids = tuple(check_int(v, f"tokens[{i}]", INT64) for i, v in enumerate(tokens))
    fields.finish()
    return DetokenizeCall(model, ids)


def check_vocabulary(tokens: Sequence[int], vocab_size: int) -> None:
    """A 400 naming the first id outside [0, vocab_size)."""
    for index, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            raise invalid(
                f"tokens[{index}]",
                f"{token} is outside the vocabulary [0, {vocab_size}) (vocab_size {vocab_size})",
            )
