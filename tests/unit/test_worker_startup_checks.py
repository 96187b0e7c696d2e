"""The worker's start-up refusals that need no model loaded: a setting the architecture does
not support, and a KV pool that cannot hold one request of max_model_len (each KV group
needing its blocks)."""

import pytest
import torch

from common.kv_groups import kv_groups
from common.model_config import ModelConfig
from services.worker.config import WorkerConfig
from services.worker.startup import check_features, check_pool_holds_a_request, kv_offload_cache
from tests.unit.test_moe_config import mixtral


def test_lora_is_refused_for_mixture_of_experts_naming_the_architecture() -> None:
    model_config = ModelConfig.from_dict(mixtral())
    check_features(WorkerConfig(model="m"), model_config)
    with pytest.raises(ValueError, match=r"^--enable-lora is not supported for mixture-of-exp"):
        check_features(WorkerConfig(model="m", enable_lora=True), model_config)


@pytest.mark.parametrize(
    ("windows", "num_blocks", "fits"),
    [
        (None, 4, True),  # 4 blocks of 16 hold 64 tokens
        (None, 3, False),
        ((8, 8), 5, True),  # one windowed group: the null block is one of the 5
        ((8, 8), 4, False),
        ((8, None), 9, True),  # two groups: (9 - null) / 2 = 4 blocks of tokens each
        ((8, None), 8, False),
    ],
)
def test_the_pool_must_hold_one_request_of_max_model_len(windows, num_blocks, fits) -> None:
    groups = kv_groups(windows, 2)
    if fits:
        check_pool_holds_a_request(num_blocks, 16, groups, 64)
        return
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len=64"):
        check_pool_holds_a_request(num_blocks, 16, groups, 64)


def test_the_kv_offload_tier_is_sized_in_blocks_and_refused_where_it_cannot_serve() -> None:
    geometry = dict(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    block_bytes = 2 * 2 * 16 * 2 * 8 * 4  # layers, K and V, slots, heads, dim, float32
    tier = kv_offload_cache(
        WorkerConfig(model="m", kv_offload_cpu_bytes="64KiB"), kv_groups(None, 2), geometry,
        block_bytes,
    )  # fmt: skip
    assert tier.num_blocks == 64 * 1024 // block_bytes and tier.data.device.type == "cpu"
    assert kv_offload_cache(WorkerConfig(model="m"), kv_groups(None, 2), geometry, 1) is None
    with pytest.raises(ValueError, match="^--kv-offload-cpu-bytes does not support sliding"):
        kv_offload_cache(
            WorkerConfig(model="m", kv_offload_cpu_bytes="64KiB"), kv_groups((8, None), 2),
            geometry, block_bytes,
        )  # fmt: skip
    with pytest.raises(ValueError, match="holds no block"):
        kv_offload_cache(
            WorkerConfig(model="m", kv_offload_cpu_bytes="1KiB"), kv_groups(None, 2), geometry,
            block_bytes,
        )  # fmt: skip
    decode = WorkerConfig(model="m", role="decode", kv_offload_cpu_bytes="64KiB")
    assert kv_offload_cache(decode, kv_groups(None, 2), geometry, block_bytes).num_blocks > 0


def test_the_disk_tier_needs_its_folder_its_budget_and_the_host_tier_before_it() -> None:
    WorkerConfig(
        model="m", kv_offload_cpu_bytes="1MiB", kv_offload_dir="/x", kv_offload_disk_bytes="1GiB"
    )
    with pytest.raises(ValueError, match="kv_offload_dir.*go together"):
        WorkerConfig(model="m", kv_offload_cpu_bytes="1MiB", kv_offload_dir="/x")
    with pytest.raises(ValueError, match="kv_offload_dir.*go together"):
        WorkerConfig(model="m", kv_offload_cpu_bytes="1MiB", kv_offload_disk_bytes="1GiB")
    with pytest.raises(ValueError, match="kv_offload_disk_bytes.*needs --kv-offload-cpu-bytes"):
        WorkerConfig(model="m", kv_offload_dir="/x", kv_offload_disk_bytes="1GiB")
