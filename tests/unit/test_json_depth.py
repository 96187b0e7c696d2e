"""`common.json_depth`: nesting measured without parsing, strings and escapes skipped."""

from __future__ import annotations

import json

import pytest

from common.json_depth import json_depth


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
