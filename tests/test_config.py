"""Typed frozen configs: flags over TANDEM_* env over defaults, clear ValueErrors."""

import dataclasses

import pytest

from common.config import load_config, parse_size
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
