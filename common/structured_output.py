"""A structured-output constraint as every service sees it: its kind and text, and its
protobuf form (`tandem.internal.v1.StructuredOutput`). Pure:
compiling it with xgrammar is `common/grammar_cache.py`'s (the gateway's check, the
workers' masks)."""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")


class ConstraintError(ValueError):
    """The constraint cannot be compiled (the message says why)."""


@dataclass(frozen=True)
class Constraint:
    kind: str
    value: str = ""  # the schema / regex / grammar text; choices: a JSON list of strings

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind must be one of {', '.join(KINDS)}")

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ConstraintError("choice needs at least one non-empty string")
        return cls("choice", json.dumps(options))


def constraint_to_pb(constraint: Constraint | None, message) -> None:
    """Fill `message` (a StructuredOutput) from `constraint` (None: leave it unset)."""
    if constraint is None:
        return
    if constraint.kind == "json_object":
        message.json_object = True
    elif constraint.kind == "choice":
        message.choice.choices.extend(json.loads(constraint.value))
    else:
        setattr(message, constraint.kind, constraint.value)


def constraint_from_pb(message) -> Constraint | None:
    """The constraint a StructuredOutput message holds (None when unset)."""
    kind = message.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "choice":
        return Constraint.choice(list(message.choice.choices))
    return Constraint(kind, getattr(message, kind))
