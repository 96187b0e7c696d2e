"""The fake workers' deterministic "model" (`tests/fake_worker.py`): the next token is a
position-sensitive hash of the whole sequence, so a test knows every token a request must
produce (`expected_tokens`) and any wrong KV (a missing or misplaced slot) changes it."""

from __future__ import annotations

from collections.abc import Sequence

VOCAB_SIZE = 1000
_MODULUS = (1 << 61) - 1


def model_token(token_ids: Sequence[int | None], vocab_size: int = VOCAB_SIZE) -> int:
    """The fake model: the next token is a position-sensitive hash of the whole sequence.
    (A missing KV slot, None, hashes differently from every token.)"""
    h = len(token_ids)
    for t in token_ids:
        h = (h * 1_000_003 + (t + 1 if t is not None else 0)) % _MODULUS
    return h % vocab_size


def fake_top(
    token_ids: Sequence[int | None], k: int, vocab_size: int = VOCAB_SIZE
) -> list[tuple[int, float]]:
    """The fake model's top-k alternatives after a sequence, as (token id, logprob), most
    likely first: distinct tokens and logprobs that are a pure function of the sequence
    (what a worker returns when a request asks for logprobs; beam search reads them)."""
    base = model_token(token_ids, vocab_size)
    tops = []
    for j in range(min(k, vocab_size)):
        token = (base + 7 * j) % vocab_size
        score = model_token([*token_ids, token], vocab_size) % 997
        tops.append((token, -(score / 100.0 + 0.001 * j)))
    tops.sort(key=lambda t: -t[1])
    return tops


def expected_tokens(
    prompt: Sequence[int],
    max_tokens: int,
    stop_token_ids: Sequence[int] = (),
    vocab_size: int = VOCAB_SIZE,
) -> list[int]:
    """The tokens the fake model generates for a prompt, up to max_tokens or a stop token."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        token = model_token(tokens, vocab_size)
        out.append(token)
        tokens.append(token)
        if token in stop_token_ids:
            break
    return out
