"""Typed reads of a JSON request body: each read names the field in its 400 error, and
`finish()` rejects every field nobody read (an unknown parameter is never silently ignored).

JSON `null` reads as "not given", like a missing field. Integers are range-checked to what
the protobuf field can hold; the gateway checks the real limits. Pure.
"""

from __future__ import annotations

from typing import Any

from services.openai_api.errors import ApiError, invalid

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT64 = (0, 2**64 - 1)


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: Any, name: str, bounds: tuple[int, int] = INT32) -> int:
    if not is_int(value):
        raise invalid(name, f"must be an integer, got {json_type(value)}", "invalid_type")
    low, high = bounds
    if not low <= value <= high:
        raise invalid(name, f"must be in [{low}, {high}], got {value}")
    return value


def check_number(value: Any, name: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise invalid(name, f"must be a number, got {json_type(value)}", "invalid_type")
    return float(value)


def check_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise invalid(name, f"must be a string, got {json_type(value)}", "invalid_type")
    return value


class Fields:
    """The fields of one JSON object (`where` names it in errors, e.g. `messages[0]`)."""

    def __init__(self, body: Any, where: str = "") -> None:
        if not isinstance(body, dict):
            what = where or "the request body"
            raise invalid(what, f"must be a JSON object, got {json_type(body)}", "invalid_type")
        self._body = body
        self._where = where
        self._read: set[str] = set()

    def name(self, key: str) -> str:
        return f"{self._where}.{key}" if self._where else key

    def get(self, key: str) -> Any:
        """The raw value (None when missing or null), marking the field as read."""
        self._read.add(key)
        return self._body.get(key)

    def missing(self, key: str) -> bool:
        """True when the field is absent (an explicit null is present)."""
        return key not in self._body

    def required(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ApiError(
                f"{self.name(key)} is required", 400, self.name(key), "missing_required_parameter"
            )
        return value

    def int(self, key: str, bounds: tuple[int, int] = INT32) -> int | None:
        value = self.get(key)
        return None if value is None else check_int(value, self.name(key), bounds)

    def number(self, key: str) -> float | None:
        value = self.get(key)
        return None if value is None else check_number(value, self.name(key))

    def str(self, key: str) -> str | None:
        value = self.get(key)
        return None if value is None else check_str(value, self.name(key))

    def bool(self, key: str) -> bool | None:
        value = self.get(key)
        if value is None or isinstance(value, bool):
            return value
        raise invalid(self.name(key), f"must be a boolean, got {json_type(value)}", "invalid_type")

    def list(self, key: str) -> list | None:
        value = self.get(key)
        if value is None or isinstance(value, list):
            return value
        raise invalid(self.name(key), f"must be an array, got {json_type(value)}", "invalid_type")

    def finish(self) -> None:
        """Reject the fields nobody read."""
        for key in self._body:
            if key not in self._read:
                raise ApiError(
                    f"{self.name(key)}: unknown or unsupported parameter",
                    400,
                    self.name(key),
                    "unknown_parameter",
                )
