"""Settings of the gateway process (`python -m services.gateway --help`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.config import (
    ServiceConfig,
    drain_timeout_setting,
    host_setting,
    log_level_setting,
    metrics_port_setting,
    model_setting,
    port_setting,
    setting,
    tokenizer_setting,
)
from services.gateway.scheduler_router import RouterConfig


def _secret_setting(help: str, env: str):
    """A `setting` kept out of the config's repr (tracebacks, logs)."""
    field = setting("", help, env=env)
    field.repr = False
    return field


def read_key_file(path: str) -> str:
    """The API key in `path` (surrounding whitespace dropped)."""
    try:
        with open(path, encoding="utf-8") as file:
            key = file.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"api_key_file: cannot read {path!r}: {exc}") from None
    if not key:
        raise ValueError(f"api_key_file: {path!r} is empty")
    return key


MAX_API_KEY_CHARS = 4096  # docs/security.md: any longer credential is wrong by length


def _check_key(key: str, what: str) -> None:
    # The key travels as a gRPC metadata / HTTP header value: printable ASCII only.
    if not key.isascii() or not key.isprintable() or key != key.strip() or " " in key:
        raise ValueError(f"{what} must be printable ASCII without spaces")
    if len(key) > MAX_API_KEY_CHARS:
        raise ValueError(f"{what} must be at most {MAX_API_KEY_CHARS} characters")


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    """The Tandem gateway: public Generate API, validation, tokenization, detokenization.
    TLS follows TANDEM_TLS_* (docs/security.md)."""

    model: str = model_setting("model folder (or GGUF file) whose tokenizer the gateway uses")
    tokenizer: str = tokenizer_setting()
    host: str = host_setting("TANDEM_GATEWAY_HOST", "listen address of the public API")
    port: int = port_setting(
        50051, "TANDEM_GATEWAY_PORT", "listen port of the public API (0 = any free port)"
    )
    served_model_name: tuple[str, ...] = setting(
        (),
        "the name(s) clients use for the model, vLLM's --served-model-name: one or more "
        "(`--served-model-name a b` or `a,b`); ListModels lists each, requests may give any; "
        "default: the model folder's name",
        env="TANDEM_SERVED_MODEL_NAME",
    )
    metrics_port: int = metrics_port_setting("TANDEM_GATEWAY_METRICS_PORT")
    scheduler: tuple[str, ...] = setting(
        ("127.0.0.1:50052",),
        "scheduler address host:port, or several comma-separated (each request goes to one, "
        "chosen by prefix-cache overlap and load; docs/architecture.md)",
        env="TANDEM_GATEWAY_SCHEDULER",
    )
    router_balance_abs_threshold: int = setting(
        32,
        "several schedulers: the longest prefix overlap wins unless its scheduler has more "
        "than this many requests in flight beyond the least-loaded one's (and the relative "
        "threshold is exceeded too)",
        env="TANDEM_ROUTER_BALANCE_ABS_THRESHOLD",
    )
    router_balance_rel_threshold: float = setting(
        1.5,
        "several schedulers: ... and more than this many times the least-loaded one's load",
        env="TANDEM_ROUTER_BALANCE_REL_THRESHOLD",
    )
    router_max_tracked_blocks: int = setting(
        32768,
        "several schedulers: prompt block hashes remembered per scheduler (an LRU)",
        env="TANDEM_ROUTER_MAX_TRACKED_BLOCKS",
    )
    router_kv_events: bool = setting(
        True,
        "several schedulers: route by what each scheduler's KV events say it caches (its "
        "KvEvents stream); off, or while a scheduler's stream is down, by the prompt blocks "
        "remembered as sent there",
        env="TANDEM_ROUTER_KV_EVENTS",
    )
    default_max_tokens: int = setting(
        4096,
        "max_tokens when a request leaves it unset (further capped by the context)",
        env="TANDEM_DEFAULT_MAX_TOKENS",
    )
    scheduler_ready_timeout_s: float = setting(
        900.0,
        "seconds to wait for the scheduler to report the model",
        env="TANDEM_SCHEDULER_READY_TIMEOUT_S",
    )
    api_key: str = _secret_setting(
        "require `authorization: Bearer KEY` on every GenerateService call (empty = no auth)",
        env="TANDEM_API_KEY",
    )
    api_key_file: str = setting(
        "", "read the API key from this file instead of --api-key", env="TANDEM_API_KEY_FILE"
    )
    max_request_bytes: str = setting(
        "16MiB",
        "largest request message the public API accepts (larger: RESOURCE_EXHAUSTED)",
        env="TANDEM_GATEWAY_MAX_REQUEST_BYTES",
    )
    drain_timeout_s: float = drain_timeout_setting(
        "on SIGTERM: seconds to let open streams finish (new requests get UNAVAILABLE)"
    )
    scheduler_health_interval_s: float = setting(
        1.0,
        "seconds between checks of the scheduler's health (the gateway mirrors it)",
        env="TANDEM_SCHEDULER_HEALTH_INTERVAL_S",
    )
    allow_runtime_lora_updating: bool = setting(
        False,
        "accept LoadLoraAdapter / UnloadLoraAdapter (and the HTTP front's "
        "/v1/load_lora_adapter, /v1/unload_lora_adapter): they make the workers read any "
        "folder the caller names (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
        env="TANDEM_ALLOW_RUNTIME_LORA_UPDATING",
    )
    max_kv_retention_s: float = setting(
        3600.0,
        "the longest kv_retention_s a request may ask for (seconds its KV is kept); longer "
        "is INVALID_ARGUMENT here, before the scheduler's own check (--max-kv-retention-s)",
        env="TANDEM_MAX_KV_RETENTION_S",
    )
    enable_auto_tool_choice: bool = setting(
        False,
        "vLLM's --enable-auto-tool-choice: parse the calls of requests with tools and "
        "tool_choice auto (needs --tool-call-parser)",
        env="TANDEM_ENABLE_AUTO_TOOL_CHOICE",
    )
    tool_call_parser: str = setting(
        "",
        "vLLM's --tool-call-parser: the format the model writes calls in (hermes, qwen3_json, "
        "llama3_json, llama4_json, mistral)",
        env="TANDEM_TOOL_CALL_PARSER",
    )
    reasoning_parser: str = setting(
        "",
        "vLLM's --reasoning-parser: split <think> reasoning from the content of chat answers "
        "(deepseek_r1, qwen3)",
        env="TANDEM_REASONING_PARSER",
    )
    chat_template: str = setting(
        "",
        "vLLM's --chat-template: a Jinja chat template (a file, or the template itself) used "
        "instead of the checkpoint's",
        env="TANDEM_CHAT_TEMPLATE",
    )
    log_level: str = log_level_setting()

    def __post_init__(self) -> None:
        self._check_service()
        self._require(
            0 <= self.max_kv_retention_s < float("inf"),
            "max_kv_retention_s",
            "must be finite and >= 0",
        )
        if not self.model:
            raise ValueError("model is required: --model FOLDER or TANDEM_MODEL")
        if not self.scheduler:
            raise self._invalid("scheduler", "needs at least one host:port")
        for address in self.scheduler:
            self._address("scheduler", address)
        if len(set(self.scheduler)) != len(self.scheduler):
            raise self._invalid("scheduler", f"lists an address twice: {', '.join(self.scheduler)}")
        self._at_least(0, "router_balance_abs_threshold")
        self._at_least(1.0, "router_balance_rel_threshold")
        self._at_least(1, "router_max_tracked_blocks")
        self._model_names("served_model_name")
        self._require(
            1024 <= self._size("max_request_bytes") <= 1 << 30,
            "max_request_bytes",
            "must be in 1KiB..1GiB",
        )
        self._positive("scheduler_health_interval_s", "scheduler_ready_timeout_s")
        self._at_least(1, "default_max_tokens")
        self._check_parsers()
        _ = self.resolved_chat_template  # refuses what is neither a file nor a template
        if self.api_key and self.api_key_file:
            raise ValueError("set api_key or api_key_file, not both")
        if self.api_key:
            _check_key(self.api_key, "api_key")
        if self.api_key_file:
            _check_key(read_key_file(self.api_key_file), f"the key in {self.api_key_file!r}")

    def _check_parsers(self) -> None:
        from services.gateway.reasoning_parsers import REASONING_PARSERS
        from services.gateway.tool_parsers import TOOL_PARSERS

        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice requires tool_call_parser")
        for key, known in (
            ("tool_call_parser", TOOL_PARSERS),
            ("reasoning_parser", REASONING_PARSERS),
        ):
            value = getattr(self, key)
            self._require(
                not value or value in known,
                key,
                f"must be one of {', '.join(sorted(known))}",
            )

    @property
    def resolved_chat_template(self) -> str | None:
        """The --chat-template's text (a file's content, or the value itself when it is no
        file but looks like a template); None: the checkpoint's."""
        if not self.chat_template:
            return None
        path = Path(self.chat_template)
        if path.is_file():
            return path.read_text()
        if not any(mark in self.chat_template for mark in ("{{", "{%")):
            raise ValueError(
                f"chat_template: {self.chat_template!r} is neither a file nor a template"
            )
        return self.chat_template

    @property
    def router_config(self) -> RouterConfig:
        return RouterConfig(
            balance_abs_threshold=self.router_balance_abs_threshold,
            balance_rel_threshold=self.router_balance_rel_threshold,
            max_tracked_blocks=self.router_max_tracked_blocks,
            kv_events=self.router_kv_events,
        )

    @property
    def resolved_api_key(self) -> str:
        """The key clients must present ('' = authentication off)."""
        return read_key_file(self.api_key_file) if self.api_key_file else self.api_key
