"""How deeply a JSON text nests, measured without parsing it (no recursion, linear time):
the guard in front of anything whose cost grows with nesting (Python's recursive `json`
module, xgrammar's schema compiler). Pure."""

from __future__ import annotations

import re

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in `text` (0 for a scalar). Brackets inside
    strings do not count; the text need not be valid JSON (unbalanced closers are ignored)."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif depth:
            depth -= 1
    return deepest
