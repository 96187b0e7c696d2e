"""Constraints for the structured-output benchmark: realistic JSON schemas (what API users
send: a record, tool-call arguments, a nested order with enums and arrays, `$defs`
references, a wide form), two regexes and an EBNF grammar, plus the schema the load runs
under (free-text fields, so random-weight outputs run to `max_tokens`)."""

from __future__ import annotations

import json

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 64},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "search_web", "send_email", "create_event"]},
        "arguments": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "query": {"type": "string"},
                "when": {"type": "string", "format": "date-time"},
            },
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
            },
        },
        "shipping": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/address"}]},
    },
    "required": ["order_id", "status", "items"],
    "$defs": {
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "country": {"type": "string", "minLength": 2, "maxLength": 2},
            },
            "required": ["street", "city", "country"],
        }
    },
}
WIDE_FORM = {
    "type": "object",
    "properties": {
        f"field_{i}": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}][i % 3]
        for i in range(40)
    },
    "required": [f"field_{i}" for i in range(0, 40, 2)],
}
COMPILE_CASES = {
    "json_schema: person": ("json_schema", json.dumps(PERSON)),
    "json_schema: tool call": ("json_schema", json.dumps(TOOL_CALL)),
    "json_schema: nested order ($defs, anyOf, pattern)": ("json_schema", json.dumps(ORDER)),
    "json_schema: 40-field form": ("json_schema", json.dumps(WIDE_FORM)),
    "json_object": ("json_object", ""),
    "regex: email": ("regex", r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,10}"),
    "regex: ISO date-time": ("regex", r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"),
    "grammar: arithmetic": (
        "grammar",
        'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") '
        'factor)*\nfactor ::= [0-9]+ | "(" expr ")"',
    ),
}
# The load's schema: two free strings, so outputs run to max_tokens on a random model.
LOAD_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "body": {"type": "string"}},
    "required": ["title", "body"],
    "additionalProperties": False,
}
