"""How deeply a JSON text nests, measured without parsing it (no recursion, linear time),
and `load_json`: `json.loads` behind that guard. It stands in front of anything whose cost
or stack grows with nesting (Python's recursive `json` module, xgrammar's schema compiler),
so that client input nested too deep is a clear error naming the limit, never a
RecursionError. Pure."""

from __future__ import annotations

import json
import re
from typing import Any

# A JSON string, escapes included (the "unrolled loop" form: linear and fast in `re`).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


class JsonTooDeep(ValueError):
    """The text nests deeper than the caller's limit."""


def json_depth(text: str, stop_above: int | None = None) -> int:
    """The deepest nesting of arrays and objects in `text` (0 for a scalar). Brackets inside
    strings do not count; the text need not be valid JSON (unbalanced closers are ignored).
    With `stop_above`, the scan ends as soon as the depth passes it (the result is then
    `stop_above + 1`)."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_above is not None and deepest > stop_above:
                    return deepest
        elif depth:
            depth -= 1
    return deepest


def load_json(data: str | bytes | bytearray, max_depth: int, what: str, **loads_kwargs) -> Any:
    """`json.loads(data)`, refusing (JsonTooDeep, a ValueError) text that nests deeper than
    `max_depth` arrays/objects, with a message naming `what` and the limit. Text with no
    more brackets than the limit cannot nest deeper, so common bodies skip the scan.
    Undecodable bytes and invalid JSON raise ValueError as `json.loads` does."""
    text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    if text.count("[") + text.count("{") > max_depth:
        depth = json_depth(text, stop_above=max_depth)
        if depth > max_depth:
            raise JsonTooDeep(f"{what} nests deeper than {max_depth} levels of arrays/objects")
    try:
        return json.loads(text, **loads_kwargs)
    except RecursionError:  # cannot happen below the limit; kept as a last line
        raise JsonTooDeep(
            f"{what} nests deeper than {max_depth} levels of arrays/objects"
        ) from None
