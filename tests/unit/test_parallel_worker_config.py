"""A parallel worker's settings and plumbing without processes: the flags that refuse what
is not built yet (one line each, naming flag and env), the settings handed to the other
ranks rebuilding the same config whatever the environment, and the rank pipe's framing."""

from __future__ import annotations

import os
import threading

import pytest

from common.config import config_argv, load_config
from services.worker.config import WorkerConfig
from services.worker.parallel.rank_channel import RESET, STEP, read_messages, write_message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be >= 1"),
        (
            {
                "pipeline_parallel_size": 2,
                "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}',
            },
            "with --speculative-config",
        ),
        (
            {
                "tensor_parallel_size": 2,
                "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}',
            },
            "with --speculative-config",
        ),
    ],
)
def test_unsupported_layouts_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError) as error:
        WorkerConfig(model="/m", **kwargs)
    text = str(error.value)
    assert message in text and "\n" not in text
    assert "--tensor-parallel-size" in text or "--pipeline-parallel-size" in text


@pytest.mark.parametrize(
    "kwargs",
    [
        {"pipeline_parallel_size": 2, "role": "decode", "kv_transfer_shared_memory": False},
        {"tensor_parallel_size": 2, "role": "prefill", "kv_transfer_shared_memory": False},
        {"tensor_parallel_size": 2, "role": "decode", "device": "cuda"},
    ],
)
def test_parallel_prefill_and_decode_workers_may_move_kv_over_ucx(kwargs):
    """Without shared memory (or on GPU) every rank sends and receives its own KV over UCX."""
    config = WorkerConfig(model="/m", **kwargs)
    assert config.world_size == 2


def test_vllm_flag_names_and_env():
    config = load_config(WorkerConfig, ["--model", "/m", "--tensor-parallel-size", "2"], env={})
    assert (config.tensor_parallel_size, config.world_size) == (2, 2)
    from_env = load_config(
        WorkerConfig, ["--model", "/m"], env={"TANDEM_TENSOR_PARALLEL_SIZE": "4"}
    )
    assert from_env.world_size == 4
    both = load_config(
        WorkerConfig,
        ["--model", "/m", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"],
        env={},
    )
    assert (both.layout.tp, both.layout.pp, both.world_size) == (2, 2, 4)
    staged = load_config(
        WorkerConfig, ["--model", "/m"], env={"TANDEM_PIPELINE_PARALLEL_SIZE": "2"}
    )
    assert staged.world_size == 2


def test_the_settings_handed_to_peer_ranks_rebuild_the_config_exactly():
    config = WorkerConfig(
        model="/m",
        tensor_parallel_size=2,
        kv_transfer_shared_memory=False,
        swap_space="0",
        max_model_len=96,
        log_level="debug",
    )
    hostile_env = {"TANDEM_MAX_MODEL_LEN": "7", "TANDEM_TENSOR_PARALLEL_SIZE": "8"}
    assert load_config(WorkerConfig, config_argv(config), env=hostile_env) == config


def test_rank_pipe_frames_steps_and_resets_and_ends_at_eof():
    read_fd, write_fd = os.pipe()
    big = bytes(range(256)) * 2048  # larger than a pipe's buffer: written in parts

    def writer():
        write_message(write_fd, STEP, b"plan-1")
        write_message(write_fd, RESET)
        write_message(write_fd, STEP, big)
        os.close(write_fd)

    thread = threading.Thread(target=writer)
    thread.start()
    got = list(read_messages(read_fd))
    thread.join()
    os.close(read_fd)
    assert got == [(STEP, b"plan-1"), (RESET, b""), (STEP, big)]
