"""Structured-output constraints compiled with `xgrammar`.

A `Constraint` (`common/structured_output.py`) is what a request asks for: a JSON schema,
any JSON object, a regex, an EBNF grammar, or a choice among strings. `GrammarCache`
compiles each distinct constraint once for the model's tokenizer (xgrammar's compiler,
whose own cache keeps the compiled automata) and raises `ConstraintError` naming the
problem for one it cannot compile. A choice becomes an EBNF alternation of JSON-escaped
string literals. JSON (schemas and json_object) allows any whitespace, as vLLM's does. A
structural tag (xgrammar's JSON format of sequences, tags, free text and inner grammars)
compiles as xgrammar reads it."""

from __future__ import annotations

import json

from common.structured_output import Constraint, ConstraintError

__all__ = ["Constraint", "ConstraintError", "GrammarCache", "choice_grammar"]
CACHE_LIMIT_BYTES = 256 << 20  # xgrammar's compiled-grammar cache (least recently used out)
# JSON may hold any whitespace between its tokens by default, as in vLLM (its xgrammar
# default; `disable_any_whitespace` turns it off there and here): a model that writes
# indented JSON keeps its habit, and the same request gets vLLM's response. (Held to single
# spaces, SmolLM2 answered differently from vLLM on all 14 cases of bench.quality; with any
# whitespace, identically.) A model with random weights may fill its budget with whitespace.


def choice_grammar(options: list[str]) -> str:
    """EBNF for exactly one of `options` (literals escaped as JSON strings, which EBNF
    string literals accept)."""
    return "root ::= " + " | ".join(json.dumps(o) for o in options)


class GrammarCache:
    def __init__(
        self, tokenizer, vocab_size: int, max_threads: int = 1, any_whitespace: bool = True
    ) -> None:
        """`tokenizer`: the model's Hugging Face tokenizer; `vocab_size`: the model's
        logits width (may exceed the tokenizer's); `any_whitespace`: JSON may hold any
        whitespace between its tokens (else single spaces after `,` and `:`)."""
        import xgrammar as xgr

        self.any_whitespace = any_whitespace
        self._xgr = xgr
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_limit_bytes=CACHE_LIMIT_BYTES
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def compile(self, constraint: Constraint):
        """The compiled grammar of `constraint` (cached by xgrammar per text)."""
        c, spaces = self._compiler, self.any_whitespace
        try:
            if constraint.kind == "json_schema":
                json.loads(constraint.value)  # a clear error for text that is not JSON
                return c.compile_json_schema(constraint.value, any_whitespace=spaces)
            if constraint.kind == "json_object":  # an object, as OpenAI's json_object means
                return c.compile_json_schema('{"type": "object"}', any_whitespace=spaces)
            if constraint.kind == "regex":
                return c.compile_regex(constraint.value)
            if constraint.kind == "grammar":
                return c.compile_grammar(constraint.value)
            if constraint.kind == "structural_tag":
                json.loads(constraint.value)
                return c.compile_structural_tag(constraint.value)
            return c.compile_grammar(choice_grammar(json.loads(constraint.value)))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ConstraintError(f"{constraint.kind}: {exc}") from exc
