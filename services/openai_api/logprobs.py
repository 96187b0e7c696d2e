"""Token log-probabilities in OpenAI's two formats (completions: parallel arrays with text
offsets; chat: one object per token with its UTF-8 bytes) and vLLM's prompt_logprobs. Pure.

Non-finite values (a token the model gives no mass) are written as -9999.0, like vLLM,
because JSON has no -Infinity. With vLLM's `return_tokens_as_token_ids`, every token string
(chosen and top alternatives, and the chat `bytes` of it) is `"token_id:<id>"`; completion
text offsets still count the real text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from common.pb.tandem.v1 import generate_pb2

FLOOR = -9999.0

Entries = Sequence[generate_pb2.TokenLogprob]


def finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def token_name(entry: generate_pb2.TokenLogprob | generate_pb2.TopLogprob, as_ids: bool) -> str:
    """The token's text, or vLLM's `token_id:<id>` under `return_tokens_as_token_ids`."""
    return f"token_id:{entry.token_id}" if as_ids else entry.token


def completion_logprobs(
    entries: Entries, text_offset: int, as_ids: bool = False
) -> tuple[dict, int]:
    """(the `logprobs` object of a completion choice or chunk, the next text offset)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        tokens.append(token_name(entry, as_ids))
        token_logprobs.append(finite(entry.logprob))
        tops.append({token_name(top, as_ids): finite(top.logprob) for top in entry.top_logprobs})
        offsets.append(text_offset)
        text_offset += len(entry.token)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return body, text_offset


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="surrogatepass"))


def _chat_token(entry: generate_pb2.TokenLogprob | generate_pb2.TopLogprob, as_ids: bool) -> dict:
    token = token_name(entry, as_ids)
    return {"token": token, "logprob": finite(entry.logprob), "bytes": _token_bytes(token)}


def chat_logprobs(entries: Entries, as_ids: bool = False) -> list[dict]:
    """The `logprobs.content` array of a chat choice or chunk."""
    return [
        {
            **_chat_token(entry, as_ids),
            "top_logprobs": [_chat_token(top, as_ids) for top in entry.top_logprobs],
        }
        for entry in entries
    ]


def prompt_logprobs(entries: Entries) -> list[dict | None]:
    """vLLM's format: None for the first prompt token, then {token id: {logprob,
    decoded_token}} holding the prompt token and its top alternatives."""
    out: list[dict | None] = [None]
    for entry in entries:
        position = {
            str(top.token_id): {"logprob": finite(top.logprob), "decoded_token": top.token}
            for top in entry.top_logprobs
        }
        position[str(entry.token_id)] = {
            "logprob": finite(entry.logprob),
            "decoded_token": entry.token,
        }
        out.append(position)
    return out
