"""Typed, frozen service configs built from CLI flags and `TANDEM_*` environment variables.

Each service declares a frozen dataclass whose fields are its settings and whose
`__post_init__` raises `ValueError` with a clear message. `load_config` turns the dataclass
into an argparse parser: every field `foo_bar` becomes `--foo-bar`, read from the environment
variable named in the field's metadata (default `TANDEM_<PREFIX>_FOO_BAR`), flag over
environment over default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10, "ki": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20, "mi": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30, "gi": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40, "ti": 2**40,
}  # fmt: skip


def setting(default: Any, help: str, env: str | None = None, choices: Sequence[str] | None = None):
    """A config field with its help text and, optionally, its exact environment variable."""
    return dataclasses.field(
        default=default, metadata={"help": help, "env": env, "choices": choices}
    )


def parse_size(text: str) -> int:
    """'512MiB' -> 536870912; '2GB' -> 2000000000; '1024' -> 1024."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1000000)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").lower()])


def parse_address(text: str, what: str) -> str:
    """Validate 'host:port' and return it unchanged."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be host:port with a port in 1..65535, got {text!r}")
    return text


def check_port(port: int, what: str) -> None:
    if not 0 <= port < 65536:
        raise ValueError(f"{what} must be in 0..65535 (0 = pick a free port), got {port}")


def _convert(raw: str, annotation: Any, name: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if raw == "" or raw.lower() == "none":
            return None
        return _convert(raw, args[0], name)
    if origin is tuple:
        (item_type, *_rest) = typing.get_args(annotation)
        return tuple(_convert(p.strip(), item_type, name) for p in raw.split(",") if p.strip())
    if annotation is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} must be true or false, got {raw!r}")
    try:
        return annotation(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {annotation.__name__}, got {raw!r}") from None


def load_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str | None = None,
    env_prefix: str = "TANDEM_",
) -> T:
    """Build `cls` from flags (argv), then environment, then field defaults.

    Raises ValueError (from conversion or the dataclass's own checks) with a clear message.
    """
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip())
    env_names: dict[str, str] = {}
    for field in dataclasses.fields(cls):
        env_name = field.metadata.get("env") or f"{env_prefix}{field.name.upper()}"
        env_names[field.name] = env_name
        help_text = f"{field.metadata.get('help', '')} [env {env_name}; default {field.default!r}]"
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            default=None,
            help=help_text,
            choices=field.metadata.get("choices"),
        )
    parsed = parser.parse_args(list(argv) if argv is not None else None)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        raw = getattr(parsed, field.name)
        source = f"--{field.name.replace('_', '-')}"
        if raw is None and env_names[field.name] in env:
            raw, source = env[env_names[field.name]], env_names[field.name]
        if raw is None:
            continue
        values[field.name] = _convert(raw, hints[field.name], source)
        choices = field.metadata.get("choices")
        if choices and values[field.name] not in choices:
            raise ValueError(f"{source} must be one of {', '.join(choices)}, got {raw!r}")
    return cls(**values)
