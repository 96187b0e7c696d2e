"""Token log-probabilities in OpenAI's two formats (completions: parallel arrays with text
offsets; chat: one object per token with its UTF-8 bytes) and vLLM's prompt_logprobs. Pure.

Non-finite values (a token the model gives no mass) are written as -9999.0, like vLLM,
because JSON has no -Infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from common.pb.tandem.v1 import generate_pb2

FLOOR = -9999.0

Entries = Sequence[generate_pb2.TokenLogprob]


def finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def completion_logprobs(entries: Entries, text_offset: int) -> tuple[dict, int]:
    """(the `logprobs` object of a completion choice or chunk, the next text offset)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        tokens.append(entry.token)
        token_logprobs.append(finite(entry.logprob))
        tops.append({top.token: finite(top.logprob) for top in entry.top_logprobs})
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


def chat_logprobs(entries: Entries) -> list[dict]:
    """The `logprobs.content` array of a chat choice or chunk."""
    return [
        {
            "token": entry.token,
            "logprob": finite(entry.logprob),
            "bytes": _token_bytes(entry.token),
            "top_logprobs": [
                {
                    "token": top.token,
                    "logprob": finite(top.logprob),
                    "bytes": _token_bytes(top.token),
                }
                for top in entry.top_logprobs
            ],
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
