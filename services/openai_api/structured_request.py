"""Structured output on the HTTP front: OpenAI's
`response_format` (`text`, `json_object`, `json_schema` with `schema` and `strict`) and
vLLM's `structured_outputs` extra (exactly one of `json`, `regex`, `choice`, `grammar`,
`json_object`, `structural_tag`), read into `GenerateRequest.structured_output`. The
gateway checks and compiles the constraint. Pure."""

from __future__ import annotations

import json

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.errors import ApiError, invalid
from services.openai_api.fields import Fields

VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def read_structured(fields: Fields, request: generate_pb2.GenerateRequest) -> None:
    out = request.structured_output
    response_format = fields.get("response_format")
    extra = fields.get("structured_outputs")
    if response_format is not None and extra is not None:
        raise ApiError(
            "set response_format or structured_outputs, not both", 400, "structured_outputs"
        )
    if response_format is not None:
        _response_format(Fields(response_format, "response_format"), out)
    elif extra is not None:
        _vllm_extra(Fields(extra, "structured_outputs"), out)


def _response_format(fields: Fields, out) -> None:
    kind = fields.required("type")
    if kind == "text":
        pass
    elif kind == "json_object":
        out.json_object = True
    elif kind == "json_schema":
        spec = Fields(fields.required("json_schema"), "response_format.json_schema")
        spec.str("name")
        spec.str("description")
        spec.bool("strict")  # xgrammar follows the schema strictly either way
        schema = spec.required("schema")
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema", "must be a JSON object")
        out.json_schema = json.dumps(schema)
        spec.finish()
    else:
        raise ApiError(
            f"response_format.type {kind!r} is not supported (text, json_object, json_schema)",
            400,
            "response_format.type",
            "unsupported_parameter",
        )
    fields.finish()


def _vllm_extra(fields: Fields, out) -> None:
    given = [k for k in VLLM_KEYS if not fields.missing(k) and fields.get(k) is not None]
    for key in VLLM_KEYS:
        fields.get(key)
    if len(given) != 1:
        raise invalid("structured_outputs", f"must set exactly one of {', '.join(VLLM_KEYS)}")
    key = given[0]
    if key == "json":
        value = fields.get("json")
        out.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif key == "structural_tag":
        value = fields.get(key)
        out.structural_tag = value if isinstance(value, str) else json.dumps(value)
    elif key == "json_object":
        if fields.bool("json_object"):
            out.json_object = True
    elif key == "choice":
        choices = fields.list("choice")
        if not all(isinstance(c, str) for c in choices):
            raise invalid("structured_outputs.choice", "must be an array of strings")
        out.choice.choices.extend(choices)
    else:
        setattr(out, key, fields.str(key))
    fields.finish()
