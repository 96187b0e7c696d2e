"""A constraint that starts after the reasoning, as vLLM applies structured output only once
the reasoning has ended: the request's constraint (a forced tool call, `structured_output`)
becomes an xgrammar structural tag of free text up to the reasoning's end tag, then the
constraint. Built as the structural tag's JSON (xgrammar compiles it where constraints are
compiled). Pure."""

from __future__ import annotations

import json

from common.pb.tandem.v1 import generate_pb2


def inner_format(message: generate_pb2.StructuredOutput) -> dict | None:
    """The structural-tag format of a constraint (None: a structural tag already, which is
    left as it is)."""
    kind = message.WhichOneof("constraint")
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": json.loads(message.json_schema)}
    if kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if kind == "regex":
        return {"type": "regex", "pattern": message.regex}
    if kind == "grammar":
        return {"type": "grammar", "grammar": message.grammar}
    if kind == "choice":
        options = [{"type": "const_string", "value": c} for c in message.choice.choices]
        return {"type": "or", "elements": options}
    return None


def after_reasoning(
    message: generate_pb2.StructuredOutput, end: str
) -> generate_pb2.StructuredOutput:
    """`message`'s constraint, holding only after free text that ends with `end`."""
    inner = inner_format(message)
    if inner is None:
        return message
    thinking = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": end}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [thinking, inner]}}
    return generate_pb2.StructuredOutput(structural_tag=json.dumps(tag))
