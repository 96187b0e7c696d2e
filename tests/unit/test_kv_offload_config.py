"""The offload tiers' settings and the names of their blocks: errors name the flag and
the limit; a tier identity's fingerprint changes with every field."""

from dataclasses import fields, replace

import pytest
import torch

from services.worker.kv_offload.config import MAX_BYTES, TierConfig
from services.worker.kv_offload.keys import BlockKey, TierIdentity
from tests.kv_offload_blocks import identity, key


def test_defaults_are_off_and_budgets_turn_tiers_on():
    assert not TierConfig().cpu_enabled and not TierConfig().disk_enabled
    config = TierConfig(cpu_bytes=1 << 30, disk_dir="/var/tandem/kv", disk_bytes=1 << 40)
    assert config.cpu_enabled and config.disk_enabled


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cpu_bytes=-1), r"--kv-offload-cpu-bytes must be in \[0, 1125899906842624\]"),
        (dict(cpu_bytes=MAX_BYTES + 1), "--kv-offload-cpu-bytes must be in"),
        (dict(cpu_bytes=1.5), "--kv-offload-cpu-bytes must be an integer"),
        (dict(cpu_bytes=True), "--kv-offload-cpu-bytes must be an integer"),
        (dict(disk_dir="/d", disk_bytes=-5), "--kv-offload-disk-bytes must be in"),
        (dict(disk_bytes=1 << 30), "--kv-offload-disk-bytes needs --kv-offload-dir"),
        (dict(disk_dir="/d"), "--kv-offload-dir needs --kv-offload-disk-bytes > 0"),
        (dict(disk_dir="a\0b", disk_bytes=1), "--kv-offload-dir must be a folder path"),
    ],
)
def test_bad_settings_name_their_flag_and_limit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TierConfig(**kwargs)


def test_a_budget_that_holds_no_block_names_the_least_it_may_be():
    config = TierConfig(cpu_bytes=1000, disk_dir="/d", disk_bytes=5000)
    with pytest.raises(ValueError, match="--kv-offload-cpu-bytes 1000 holds no block: .*1024"):
        config.check_block_fits(1024)
    with pytest.raises(ValueError, match="--kv-offload-disk-bytes 5000 .* at least 8320"):
        TierConfig(disk_dir="/d", disk_bytes=5000).check_block_fits(8192)
    TierConfig().check_block_fits(1 << 20)  # off: nothing to hold
    config.check_block_fits(512)


def test_block_keys_are_a_32_byte_hash_and_a_group():
    assert key(0) == BlockKey(key(0).block_hash, 0) != key(0, group=1)
    with pytest.raises(ValueError, match="32 bytes"):
        BlockKey(b"\0" * 31)
    with pytest.raises(ValueError, match="out of range"):
        BlockKey(b"\0" * 32, -1)
    with pytest.raises(ValueError, match="an int"):
        BlockKey(b"\0" * 32, True)


def test_every_identity_field_changes_the_fingerprint():
    base = identity(tp_size=2, pp_size=2)
    assert len(base.fingerprint) == 32
    assert base.fingerprint == identity(tp_size=2, pp_size=2).fingerprint
    changed = {
        "model": "other",
        "num_slots": 3,
        "block_size": 8,
        "block_bytes": 2048,
        "dtype": "torch.bfloat16",
        "tp_rank": 1,
        "tp_size": 4,
        "pp_rank": 1,
        "pp_size": 4,
    }
    assert set(changed) == {f.name for f in fields(TierIdentity)}
    prints = {replace(base, **{name: value}).fingerprint for name, value in changed.items()}
    assert len(prints) == len(changed) and base.fingerprint not in prints


def test_identity_takes_a_torch_dtype_and_refuses_nonsense():
    assert identity(dtype=torch.bfloat16).dtype == "torch.bfloat16"
    with pytest.raises(ValueError, match="tp_rank must be in"):
        identity(tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="block_bytes must be a positive int"):
        identity(block_bytes=0)
    with pytest.raises(ValueError, match="model"):
        identity(model="")
