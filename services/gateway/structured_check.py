"""Checks a request's structured-output constraint before any work starts: sizes against
limits, then a compile with xgrammar for the model's tokenizer off the event loop and
within a time limit, each distinct constraint once (the verdict is
cached). A constraint that fails is INVALID_ARGUMENT naming the field and the reason.

xgrammar imports torch, which the gateway otherwise keeps out (`__main__.keep_torch_out`):
it is loaded here, on a thread, the first time a constrained request arrives."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
from collections import OrderedDict

from common.json_depth import json_depth
from common.structured_output import Constraint, ConstraintError, constraint_from_pb
from services.gateway.validation import InvalidArgumentError

MAX_TEXT_BYTES = {
    "json_schema": 64 << 10,
    "regex": 4 << 10,
    "grammar": 64 << 10,
    "structural_tag": 64 << 10,
}
# xgrammar's schema compile grows ~cubically with nesting (50 levels of objects: 50 ms,
# 100: 0.7 s, 200: 9 s): real schemas nest far less than this many JSON levels.
MAX_SCHEMA_DEPTH = 64
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
COMPILE_TIMEOUT_S = 10.0
VERDICTS = 1024  # distinct constraints whose verdict is remembered


def check_limits(message) -> Constraint:
    """The constraint of a StructuredOutput message, within the size limits."""
    kind = message.WhichOneof("constraint")
    field = f"structured_output.{kind}"
    if kind in MAX_TEXT_BYTES:
        size = len(getattr(message, kind).encode("utf-8"))
        if not 1 <= size <= MAX_TEXT_BYTES[kind]:
            raise InvalidArgumentError(
                f"{field} must be 1..{MAX_TEXT_BYTES[kind]} bytes, got {size}"
            )
        if kind in ("json_schema", "structural_tag"):
            depth = json_depth(getattr(message, kind))
            if depth > MAX_SCHEMA_DEPTH:
                raise InvalidArgumentError(
                    f"{field} must nest at most {MAX_SCHEMA_DEPTH} levels, got {depth}"
                )
    if kind == "choice":
        choices = list(message.choice.choices)
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise InvalidArgumentError(f"{field} must hold 1..{MAX_CHOICES} strings")
        if not all(1 <= len(c) <= MAX_CHOICE_CHARS for c in choices):
            raise InvalidArgumentError(f"{field} strings must be 1..{MAX_CHOICE_CHARS} characters")
    try:
        return constraint_from_pb(message)
    except ConstraintError as exc:
        raise InvalidArgumentError(f"{field}: {exc}") from None


class ConstraintChecker:
    def __init__(self, tokenizer, vocab_size: int, timeout_s: float = COMPILE_TIMEOUT_S):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._timeout_s = timeout_s
        self._grammars = None
        # One compile at a time: many slow schemas cannot take every core of the gateway.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._verdicts: OrderedDict[Constraint, str] = OrderedDict()  # "" = compiles

    def _compile(self, constraint: Constraint) -> str:
        if self._grammars is None:
            if sys.modules.get("torch", False) is None:
                del sys.modules["torch"]  # xgrammar needs it: load it now, once
            from common.grammar_cache import GrammarCache

            self._grammars = GrammarCache(self._tokenizer, self._vocab_size)
        try:
            self._grammars.compile(constraint)
        except ConstraintError as exc:
            return str(exc)
        return ""

    async def check(self, message) -> None:
        """InvalidArgumentError when the constraint breaks a limit or does not compile."""
        constraint = check_limits(message)
        verdict = self._verdicts.get(constraint)
        if verdict is None:
            try:
                compiling = asyncio.get_running_loop().run_in_executor(
                    self._thread, self._compile, constraint
                )
                verdict = await asyncio.wait_for(compiling, self._timeout_s)
            except TimeoutError:
                raise InvalidArgumentError(
                    f"structured_output.{constraint.kind} did not compile within "
                    f"{self._timeout_s:g} s"
                ) from None
            self._verdicts[constraint] = verdict
            while len(self._verdicts) > VERDICTS:
                self._verdicts.popitem(last=False)
        if verdict:
            raise InvalidArgumentError(f"structured_output.{verdict}")
