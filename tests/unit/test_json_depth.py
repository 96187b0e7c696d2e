"""`common.json_depth`: nesting measured without parsing, strings and escapes skipped."""

from __future__ import annotations

import json

import pytest

from common.json_depth import JsonTooDeep, json_depth, load_json


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("1", 0),
        ('"[{[{"', 0),
        ("[]", 1),
        ('{"a": [1, {"b": [[]]}]}', 5),
        ('{"a": "x\\"[[[", "b": [1]}', 2),  # an escaped quote does not end the string
        ("[[[", 3),  # unbalanced: counted as far as it goes
        ("]]][", 1),
    ],
)
def test_depth(text, depth):
    assert json_depth(text) == depth


def test_agrees_with_a_parse_and_is_linear_on_a_deep_text():
    value = {"a": [{"b": {"c": [1, 2, {"d": "}}]]"}]}}]}
    assert json_depth(json.dumps(value)) == 6
    deep = "[" * 1_000_000 + "]" * 1_000_000  # json.loads would raise RecursionError
    assert json_depth(deep) == 1_000_000


def test_stop_above_ends_the_scan_past_the_limit():
    assert json_depth("[" * 1000 + "]" * 1000, stop_above=10) == 11
    assert json_depth("[[[]]]", stop_above=10) == 3


@pytest.mark.parametrize(
    "text",
    ["[" * 129 + "]" * 129, '{"a":' * 10**5 + "1" + "}" * 10**5, "[" * 10**6 + "]" * 10**6],
)
def test_load_json_refuses_nesting_past_the_limit_naming_it(text):
    with pytest.raises(JsonTooDeep, match="request body nests deeper than 128 levels"):
        load_json(text, 128, "request body")
    with pytest.raises(JsonTooDeep):
        load_json(text.encode(), 128, "request body")


def test_load_json_parses_within_the_limit_and_keeps_json_errors():
    text = "[" * 128 + "]" * 128
    assert load_json(text, 128, "x") == json.loads(text)
    many = json.dumps([{"k": [i]} for i in range(1000)])  # many brackets, shallow
    assert load_json(many, 3, "x") == json.loads(many)
    assert load_json('"[[[[[["', 2, "x") == "[[[[[["  # brackets inside a string
    with pytest.raises(ValueError) as info:
        load_json("{", 128, "x")
    assert not isinstance(info.value, JsonTooDeep)
    with pytest.raises(ValueError):
        load_json(b"\xff", 128, "x")
