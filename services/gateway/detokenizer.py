"""Incremental detokenization: turn a growing list of token ids into text deltas.

Decoding one token at a time is wrong twice over: a multi-byte character split across
tokens decodes to U+FFFD halves, and tokenizers that join pieces with spaces (SentencePiece)
lose the space. So each step decodes a small window twice, ending where text was last
emitted (`read_offset`) and ending now, and emits the difference, holding it back while it
ends in an incomplete character. `flush()` emits whatever is left when generation stops,
so the concatenated deltas equal `tokenizer.decode(all output ids)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context so the first output token decodes with its spacing.
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        # A context that itself ends inside a character would swallow the first output
        # bytes into it; start without context then.
        if REPLACEMENT in self._decode(context):
            context = []
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _pending(self) -> tuple[str, str]:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        return prefix, full

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new tokens; return the text they complete (may be empty)."""
        self._ids.extend(token_ids)
        prefix, full = self._pending()
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Return any text still held back (an incomplete character decodes as U+FFFD)."""
        prefix, full = self._pending()
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
