"""`echo` with `logprobs` on `/v1/completions`, as vLLM answers it and evaluation harnesses
(lm-eval's `local-completions` loglikelihood tasks) read it: the choice's `logprobs` cover
the prompt's tokens first (the first one with a null logprob and null alternatives: nothing
precedes it), then the generated ones; with `max_tokens: 0` only the prompt's. The prompt
tokens' logprobs are the gateway's `prompt_logprobs` (the model's raw distribution), each
position's alternatives cut to `logprobs` and holding the prompt token itself, as vLLM's do.
Pure."""

from __future__ import annotations

from collections.abc import Sequence

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.logprobs import completion_logprobs, finite, token_name

FirstToken = tuple[int, str]  # a prompt's first token: (id, text)


def prompt_part(
    first: FirstToken,
    entries: Sequence[generate_pb2.TokenLogprob],
    k: int,
    as_ids: bool = False,
) -> tuple[dict, int]:
    """(the prompt's `logprobs` arrays, the text offset after them); `as_ids`: tokens
    written as vLLM's `token_id:<id>` (`return_tokens_as_token_ids`)."""
    first_name = f"token_id:{first[0]}" if as_ids else first[1]
    tokens, token_logprobs, tops, offsets = [first_name], [None], [None], [0]
    offset = len(first[1])
    for entry in entries:
        tokens.append(token_name(entry, as_ids))
        token_logprobs.append(finite(entry.logprob))
        alternatives = {
            token_name(top, as_ids): finite(top.logprob) for top in entry.top_logprobs[:k]
        }
        alternatives.setdefault(token_name(entry, as_ids), finite(entry.logprob))
        tops.append(alternatives)
        offsets.append(offset)
        offset += len(entry.token)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return body, offset


def echoed_logprobs(
    first: FirstToken,
    prompt_entries: Sequence[generate_pb2.TokenLogprob],
    generated: Sequence[generate_pb2.TokenLogprob],
    k: int,
    as_ids: bool = False,
) -> dict:
    """One choice's whole `logprobs` object: the prompt's tokens, then `generated`."""
    head, offset = prompt_part(first, prompt_entries, k, as_ids)
    tail, _ = completion_logprobs(generated, offset, as_ids)
    return {key: head[key] + tail[key] for key in head}
