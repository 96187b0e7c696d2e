"""Typed, frozen service configs built from CLI flags and `TANDEM_*` environment variables.

Each service declares a frozen dataclass (a `ServiceConfig`) whose fields are its settings
and whose `__post_init__` raises `ValueError` with a clear message naming the setting, its
flag and its environment variable. Every check of a setting lives there, once: the code that
receives a config trusts it. `load_config` turns the dataclass into an argparse parser:
every field `foo_bar` becomes `--foo-bar`, read from the environment variable named in the
field's metadata (default `TANDEM_FOO_BAR`), flag over environment over default.

Settings that must agree across services are checked when they meet: the worker sends its
side as metadata of `DescribeWorker` (the keys below) and the scheduler compares it with its
own when it connects (`services/scheduler/bootstrap.py`).
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

LOG_LEVELS = ("debug", "info", "warning", "error")
LOOPBACK = "127.0.0.1"
DEFAULT_ENV_PREFIX = "TANDEM_"

# Worker settings sent as initial metadata of DescribeWorker (no proto change) for the
# scheduler to check against its own: tokens the worker profiled activation memory for (sent
# only by a worker that profiled: CUDA), and its KV transfer timeout.
PROFILE_NUM_TOKENS_METADATA = "tandem-profile-num-tokens"
KV_TRANSFER_TIMEOUT_METADATA = "tandem-kv-transfer-timeout-s"

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


def host_setting(env: str, help: str = "listen address (loopback by default)"):
    """A service's listen address: loopback unless told otherwise."""
    return setting(LOOPBACK, help, env=env)


def port_setting(default: int, env: str, help: str = "listen port (0 = any free port)"):
    return setting(default, help, env=env)


def metrics_port_setting(env: str):
    """A gRPC service's Prometheus endpoint (`common/metrics.py`; plain HTTP on its host)."""
    return setting(
        0,
        "port of the Prometheus metrics endpoint (plain HTTP GET /metrics on --host; 0 = off)",
        env=env,
    )


def log_level_setting():
    return setting(
        "info", "debug, info, warning or error", env="TANDEM_LOG_LEVEL", choices=LOG_LEVELS
    )


def model_setting(help: str):
    """`--model`: a Hugging Face folder or a GGUF file (one variable for every service)."""
    return setting("", help, env="TANDEM_MODEL")


def tokenizer_setting():
    """`--tokenizer` (vLLM's): with a GGUF `--model`, a tokenizer folder to use instead of
    the one the file carries."""
    return setting(
        "",
        "with a .gguf --model: a tokenizer folder to use instead of the file's own",
        env="TANDEM_TOKENIZER",
    )


def drain_timeout_setting(help: str):
    """Seconds a service drains on SIGTERM (one variable for every service)."""
    return setting(30.0, help, env="TANDEM_DRAIN_TIMEOUT_S")


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(field: dataclasses.Field, env_prefix: str = DEFAULT_ENV_PREFIX) -> str:
    return field.metadata.get("env") or f"{env_prefix}{field.name.upper()}"


MAX_MODEL_NAME_CHARS = 128


class ServiceConfig:
    """Base of every service's config: the settings every service has, checked once.

    A subclass is a frozen dataclass that declares `host`, `port` and `log_level` (and
    `drain_timeout_s` when it drains on SIGTERM, `metrics_port` when it serves metrics)
    with its own environment names and defaults
    (`host_setting`, `port_setting`, `log_level_setting`, `drain_timeout_setting`), and
    starts its `__post_init__` with `self._check_service()`. Its own checks use `_require`,
    `_at_least`, `_positive`, `_size` and `_address`, whose errors name the setting, its flag
    and its environment variable.
    """

    def _check_service(self) -> None:
        self._require(bool(self.host), "host", "must not be empty")
        self._require(0 <= self.port < 65536, "port", "must be in 0..65535 (0 = pick a free port)")
        self._require(
            self.log_level in LOG_LEVELS, "log_level", f"must be one of {', '.join(LOG_LEVELS)}"
        )
        if hasattr(self, "metrics_port"):
            self._require(
                0 <= self.metrics_port < 65536, "metrics_port", "must be in 0..65535 (0 = off)"
            )
            self._require(
                not self.metrics_port or self.metrics_port != self.port,
                "metrics_port",
                "must differ from --port",
            )
        if hasattr(self, "drain_timeout_s"):
            self._at_least(0, "drain_timeout_s")

    def _invalid(self, name: str, problem: str) -> ValueError:
        """'max_num_seqs must be >= 1, got 0 (flag --max-num-seqs, env TANDEM_MAX_NUM_SEQS)'."""
        field = next(f for f in dataclasses.fields(self) if f.name == name)
        return ValueError(f"{name} {problem} (flag {flag_name(name)}, env {env_name(field)})")

    def _require(self, ok: bool, name: str, rule: str) -> None:
        if not ok:
            raise self._invalid(name, f"{rule}, got {getattr(self, name)!r}")

    def _at_least(self, minimum: float, *names: str) -> None:
        for name in names:  # NaN compares False: it fails too
            self._require(getattr(self, name) >= minimum, name, f"must be >= {minimum}")

    def _positive(self, *names: str) -> None:
        for name in names:
            self._require(getattr(self, name) > 0, name, "must be positive")

    def _size(self, name: str) -> int:
        """The size setting `name` in bytes ('512MiB' -> 536870912)."""
        try:
            return parse_size(getattr(self, name))
        except ValueError as exc:
            raise self._invalid(name, f"is {exc}") from None

    def _model_names(self, name: str) -> None:
        """Setting `name` lists model names (vLLM's --served-model-name): each 1..128
        printable characters without surrounding spaces, no two alike."""
        names = getattr(self, name)
        for each in names:
            ok = 1 <= len(each) <= MAX_MODEL_NAME_CHARS and each.isprintable()
            self._require(ok and each == each.strip(), name,
                          f"names must be 1..{MAX_MODEL_NAME_CHARS} printable characters "
                          "without surrounding spaces")  # fmt: skip
        self._require(len(set(names)) == len(names), name, "must not repeat a name")

    def _address(self, name: str, text: str) -> None:
        """`text` (setting `name`, or one of its items) must be host:port."""
        if not is_address(text):
            raise self._invalid(name, f"must be host:port with a port in 1..65535, got {text!r}")


def parse_size(text: str) -> int:
    """'512MiB' -> 536870912; '2GB' -> 2000000000; '1024' -> 1024."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1000000)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").lower()])


def is_address(text: str) -> bool:
    """Whether `text` is 'host:port' with a port in 1..65535."""
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


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
    env_prefix: str = DEFAULT_ENV_PREFIX,
) -> T:
    """Build `cls` from flags (argv), then environment, then field defaults.

    Raises ValueError (from conversion or the dataclass's own checks) with a clear message.
    """
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip())
    env_names: dict[str, str] = {}
    for field in dataclasses.fields(cls):
        env_names[field.name] = env_name(field, env_prefix)
        help_text = (
            f"{field.metadata.get('help', '')} [env {env_names[field.name]}; "
            f"default {field.default!r}]"
        )
        # A bool flag alone means true (`--enable-lora`, as vLLM's); a value still works.
        switch = {"nargs": "?", "const": "true"} if hints[field.name] is bool else {}
        if typing.get_origin(hints[field.name]) is tuple:
            switch = {"nargs": "+"}  # `--flag a b` as vLLM's lists, or `--flag a,b`
        parser.add_argument(
            flag_name(field.name),
            dest=field.name,
            default=None,
            help=help_text.replace("%", "%%"),  # argparse formats help with %
            choices=field.metadata.get("choices"),
            **switch,
        )
    parsed = parser.parse_args(list(argv) if argv is not None else None)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        raw = getattr(parsed, field.name)
        if isinstance(raw, list):
            raw = ",".join(raw)
        source = flag_name(field.name)
        if raw is None and env_names[field.name] in env:
            raw, source = env[env_names[field.name]], env_names[field.name]
        if raw is None:
            continue
        values[field.name] = _convert(raw, hints[field.name], source)
        choices = field.metadata.get("choices")
        if choices and values[field.name] not in choices:
            raise ValueError(f"{source} must be one of {', '.join(choices)}, got {raw!r}")
    return cls(**values)


def config_argv(config: ServiceConfig) -> list[str]:
    """Flags that make `load_config` rebuild `config` exactly (every field, so the
    environment cannot change it): how a worker hands its settings to the ranks it starts."""
    argv: list[str] = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is None:
            text = "none"
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, tuple):
            text = ",".join(str(v) for v in value)
        else:
            text = str(value)
        argv += [flag_name(field.name), text]
    return argv
