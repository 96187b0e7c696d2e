"""Typed frozen configs: flags over TANDEM_* env over defaults, clear ValueErrors."""

import dataclasses

import pytest

from common.config import ServiceConfig, load_config, parse_size
from services.gateway.config import GatewayConfig
from services.openai_api.config import OpenAIApiConfig
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig


def test_flags_override_env_which_overrides_defaults():
    env = {"TANDEM_MODEL": "/m", "TANDEM_WORKER_PORT": "6000", "TANDEM_BLOCK_SIZE": "32"}
    cfg = load_config(WorkerConfig, ["--port", "7000", "--role", "decode"], env=env)
    assert (cfg.model, cfg.port, cfg.block_size, cfg.role) == ("/m", 7000, 32, "decode")
    assert cfg.max_model_len == 0  # default
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1


def test_tuple_and_bool_fields_parse_from_strings():
    cfg = load_config(
        SchedulerConfig, [], env={"TANDEM_SCHEDULER_WORKERS": "127.0.0.1:1, 127.0.0.1:2"}
    )
    assert cfg.workers == ("127.0.0.1:1", "127.0.0.1:2")


@pytest.mark.parametrize(
    "cls, argv, message",
    [
        (WorkerConfig, [], "model is required"),
        (WorkerConfig, ["--model", "m", "--port", "x"], "--port must be int"),
        (WorkerConfig, ["--model", "m", "--port", "70000"], "port must be in 0..65535"),
        (WorkerConfig, ["--model", "m", "--block-size", "12"], "power of two"),
        (WorkerConfig, ["--model", "m", "--kv-cache-memory", "lots"], "not a size"),
        (WorkerConfig, ["--model", "m", "--gpu-memory-utilization", "1.5"], r"\(0, 1\]"),
        (SchedulerConfig, [], "workers is required"),
        (SchedulerConfig, ["--workers", "localhost"], "host:port"),
        (SchedulerConfig, ["--workers", "a:1,a:1"], "twice"),
        (SchedulerConfig, ["--workers", "a:1", "--max-num-seqs", "0"], "max_num_seqs"),
        (SchedulerConfig, ["--workers", "a:1", "--max-waiting-requests", "0"], "max_waiting_req"),
        (SchedulerConfig, ["--workers", "a:1", "--max-waiting-tokens", "0"], "max_waiting_tok"),
        (SchedulerConfig, ["--workers", "a:1", "--max-restarts", "-1"], "max_restarts"),
        (
            SchedulerConfig,
            ["--workers", "a:1", "--worker-health-timeout-s", "0"],
            "worker_health_timeout_s",
        ),
        (SchedulerConfig, ["--workers", "a:1", "--step-timeout-s", "-1"], "step_timeout_s"),
        (SchedulerConfig, ["--workers", "a:1", "--drain-timeout-s", "-1"], "drain_timeout_s"),
        (WorkerConfig, ["--model", "m", "--drain-timeout-s", "-2"], "drain_timeout_s"),
        (GatewayConfig, ["--model", "m", "--scheduler", "nope"], "scheduler must be host:port"),
        (GatewayConfig, ["--model", "m", "--scheduler", "a:1,b:0"], "scheduler must be host:port"),
        (GatewayConfig, ["--model", "m", "--scheduler", "a:1,a:1"], "scheduler lists an address"),
        (GatewayConfig, ["--model", "m", "--scheduler", ","], "scheduler needs at least one"),
        (
            GatewayConfig,
            ["--model", "m", "--router-balance-rel-threshold", "0.9"],
            "router_balance_rel_threshold must be >= 1.0",
        ),
        (
            GatewayConfig,
            ["--model", "m", "--router-balance-abs-threshold", "-1"],
            "router_balance_abs_threshold must be >= 0",
        ),
        (
            GatewayConfig,
            ["--model", "m", "--router-max-tracked-blocks", "0"],
            "router_max_tracked_blocks must be >= 1",
        ),
        (GatewayConfig, ["--model", "m", "--default-max-tokens", "0"], "default_max_tokens"),
    ],
)
def test_bad_settings_raise_value_error_naming_the_setting(cls, argv, message):
    with pytest.raises(ValueError, match=message):
        load_config(cls, argv, env={})


def test_env_errors_name_the_variable():
    with pytest.raises(ValueError, match="TANDEM_WORKER_PORT must be int"):
        load_config(WorkerConfig, ["--model", "m"], env={"TANDEM_WORKER_PORT": "abc"})


def test_role_choices_are_enforced():
    with pytest.raises(SystemExit):  # argparse rejects the flag
        load_config(WorkerConfig, ["--model", "m", "--role", "boss"], env={})
    with pytest.raises(ValueError, match="TANDEM_WORKER_ROLE must be one of"):
        load_config(WorkerConfig, ["--model", "m"], env={"TANDEM_WORKER_ROLE": "boss"})


@pytest.mark.parametrize(
    "text, value", [("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1024", 1024), ("1.5KiB", 1536)]
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("cls", [GatewayConfig, SchedulerConfig, WorkerConfig, OpenAIApiConfig])
def test_every_service_listens_on_loopback_unless_told_otherwise(cls):
    host = {f.name: f for f in dataclasses.fields(cls)}["host"]
    assert host.default == "127.0.0.1"


# --- the settings every service has, checked once (ServiceConfig) ---------------------------

REQUIRED = {
    GatewayConfig: ["--model", "m"],
    SchedulerConfig: ["--workers", "a:1"],
    WorkerConfig: ["--model", "m"],
    OpenAIApiConfig: [],
}
# Every service keeps its own environment names for the shared settings.
ENV_NAMES = {
    GatewayConfig: ("TANDEM_GATEWAY_HOST", "TANDEM_GATEWAY_PORT", 50051),
    SchedulerConfig: ("TANDEM_SCHEDULER_HOST", "TANDEM_SCHEDULER_PORT", 50052),
    WorkerConfig: ("TANDEM_WORKER_HOST", "TANDEM_WORKER_PORT", 50061),
    OpenAIApiConfig: ("TANDEM_HTTP_HOST", "TANDEM_HTTP_PORT", 8000),
}


@pytest.mark.parametrize("cls", list(REQUIRED))
def test_shared_settings_keep_each_service_env_names_and_defaults(cls):
    host_env, port_env, default_port = ENV_NAMES[cls]
    assert issubclass(cls, ServiceConfig)
    default = load_config(cls, REQUIRED[cls], env={})
    assert (default.host, default.port, default.log_level) == ("127.0.0.1", default_port, "info")
    env = {host_env: "0.0.0.0", port_env: "0", "TANDEM_LOG_LEVEL": "debug"}
    if hasattr(default, "drain_timeout_s"):
        assert default.drain_timeout_s == 30.0
        env["TANDEM_DRAIN_TIMEOUT_S"] = "5"
    cfg = load_config(cls, REQUIRED[cls], env=env)
    assert (cfg.host, cfg.port, cfg.log_level) == ("0.0.0.0", 0, "debug")
    assert getattr(cfg, "drain_timeout_s", 5.0) == 5.0
    flags = load_config(cls, [*REQUIRED[cls], "--host", "::1", "--port", "9"], env=env)
    assert (flags.host, flags.port) == ("::1", 9)


@pytest.mark.parametrize("cls", list(REQUIRED))
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "70000"], r"port must be in 0..65535 .*got 70000 \(flag --port, env {port}\)"),
        (["--port", "-1"], r"port must be in 0..65535"),
        (["--host", ""], r"host must not be empty, got '' \(flag --host, env {host}\)"),
    ],
)
def test_shared_settings_are_checked_for_every_service(cls, argv, message):
    host_env, port_env, _ = ENV_NAMES[cls]
    with pytest.raises(ValueError, match=message.format(host=host_env, port=port_env)):
        load_config(cls, [*REQUIRED[cls], *argv], env={})


@pytest.mark.parametrize("cls", list(REQUIRED))
def test_log_level_is_checked_for_every_service(cls):
    with pytest.raises(ValueError, match="TANDEM_LOG_LEVEL must be one of debug, info"):
        load_config(cls, REQUIRED[cls], env={"TANDEM_LOG_LEVEL": "loud"})
    with pytest.raises(SystemExit):  # argparse rejects the flag
        load_config(cls, [*REQUIRED[cls], "--log-level", "loud"], env={})
    config = load_config(cls, REQUIRED[cls], env={})
    with pytest.raises(ValueError, match="log_level must be one of"):
        dataclasses.replace(config, log_level="loud")


@pytest.mark.parametrize("cls", [GatewayConfig, SchedulerConfig, WorkerConfig])
@pytest.mark.parametrize("value", ["-1", "nan"])
def test_drain_timeout_is_checked_for_every_service_that_drains(cls, value):
    with pytest.raises(ValueError, match="drain_timeout_s must be >= 0.*TANDEM_DRAIN_TIMEOUT_S"):
        load_config(cls, REQUIRED[cls], env={"TANDEM_DRAIN_TIMEOUT_S": value})


# --- SchedulerConfig checks everything the engine's parts used to check on their own ---------


@pytest.mark.parametrize(
    "flag, value, message",
    [
        # Resilience (engine.py)
        ("--max-waiting-requests", "0", "max_waiting_requests must be >= 1"),
        ("--max-waiting-tokens", "0", "max_waiting_tokens must be >= 1"),
        ("--max-restarts", "-1", "max_restarts must be >= 0"),
        # PoolScheduler.__init__ (pool_scheduler.py)
        ("--max-num-batched-tokens", "0", "max_num_batched_tokens must be >= 1"),
        ("--max-num-seqs", "0", "max_num_seqs must be >= 1"),
        # PoolMonitor.__init__ (pool_monitor.py)
        ("--worker-health-interval-s", "0", "worker_health_interval_s must be positive"),
        ("--worker-health-timeout-s", "0", "worker_health_timeout_s must be positive"),
        ("--worker-health-max-misses", "0", "worker_health_max_misses must be >= 1"),
        # the rest of the scheduler's own
        ("--kv-transfer-timeout-s", "0", "kv_transfer_timeout_s must be positive"),
        ("--worker-ready-timeout-s", "nan", "worker_ready_timeout_s must be positive"),
        ("--step-timeout-s", "-1", "step_timeout_s must be positive"),
    ],
)
def test_scheduler_checks_name_the_setting_its_flag_and_env(flag, value, message):
    field = {f.name: f for f in dataclasses.fields(SchedulerConfig)}[flag[2:].replace("-", "_")]
    env = field.metadata["env"]
    with pytest.raises(ValueError, match=f"{message}, got .* \\(flag {flag}, env {env}\\)"):
        load_config(SchedulerConfig, ["--workers", "a:1", flag, value], env={})
    with pytest.raises(ValueError, match=message):  # from the environment too
        load_config(SchedulerConfig, ["--workers", "a:1"], env={env: value})


def test_scheduler_checks_preemption_mode_also_when_built_directly():
    with pytest.raises(ValueError, match="preemption_mode must be one of recompute, swap"):
        SchedulerConfig(workers=("a:1",), preemption_mode="drop")


@pytest.mark.parametrize(
    "cls, argv, message",
    [
        (WorkerConfig, ["--model", "m", "--kv-cache-memory", "lots"], "kv_cache_memory is not a"),
        (WorkerConfig, ["--model", "m", "--cuda-graph-max-batch-size", "0"], "1..1024"),
        (WorkerConfig, ["--model", "m", "--torch-threads", "-1"], "torch_threads must be >= 0"),
        (WorkerConfig, ["--model", "m", "--profile-num-tokens", "0"], "profile_num_tokens"),
        (GatewayConfig, ["--model", "m", "--max-request-bytes", "2GiB"], "1KiB..1GiB"),
        (OpenAIApiConfig, ["--max-body-size", "0"], "max_body_size must be at least 1 byte"),
    ],
)
def test_service_specific_checks(cls, argv, message):
    with pytest.raises(ValueError, match=message):
        load_config(cls, argv, env={})


@pytest.mark.parametrize("cls", list(REQUIRED))
def test_help_lists_every_flag_with_its_env(cls, capsys):
    with pytest.raises(SystemExit) as exited:
        load_config(cls, ["--help"], env={})
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for field in dataclasses.fields(cls):
        assert "--" + field.name.replace("_", "-") in text
    assert "env TANDEM_LOG_LEVEL" in text


def test_gateway_takes_one_or_several_schedulers():
    one = load_config(GatewayConfig, ["--model", "m"], env={})
    assert one.scheduler == ("127.0.0.1:50052",)
    several = load_config(
        GatewayConfig, ["--model", "m"], env={"TANDEM_GATEWAY_SCHEDULER": "a:1, b:2"}
    )
    assert several.scheduler == ("a:1", "b:2")
    assert several.router_config.balance_abs_threshold == 32
