"""vLLM's KV offloading flags (`--kv-offloading-size`, `--kv-offloading-backend`,
`--kv-transfer-config` with the OffloadingConnector) read into Tandem's tiers: a worker's
settings come out as if Tandem's own flags had been given; anything Tandem does not honour
is one clear line naming the flag and the field."""

import dataclasses
import json

import pytest

from common.kv_offloading_config import GIB, OffloadTiers, parse_offloading
from services.worker.config import WorkerConfig


def connector(**extra) -> str:
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }  # fmt: skip
    )


def fs(root="/var/kv", max_bytes=8 * GIB, **more) -> dict:
    return {"type": "fs", "root_dir": root, "max_bytes": max_bytes, **more}


def test_vllm_s_offloading_settings_become_tandem_s_tiers():
    assert parse_offloading("") is None and parse_offloading("", 0.0, "lmcache") is None
    assert parse_offloading("", 2) == OffloadTiers(2 * GIB)
    assert parse_offloading("", 0.5, "native") == OffloadTiers(GIB // 2)
    assert parse_offloading(connector(cpu_bytes_to_use=123456789)) == OffloadTiers(123456789)
    tiering = connector(cpu_bytes_to_use=GIB, spec_name="TieringOffloadingSpec",
                        secondary_tiers=[fs()], eviction_policy="lru")  # fmt: skip
    assert parse_offloading(tiering) == OffloadTiers(GIB, "/var/kv", 8 * GIB)
    # As in vLLM, the size fills cpu_bytes_to_use of a connector config given beside it.
    assert parse_offloading(tiering, 3) == OffloadTiers(3 * GIB, "/var/kv", 8 * GIB)


@pytest.mark.parametrize(
    ("config", "size", "backend", "message"),
    [
        ("{", 0, "native", "--kv-transfer-config: not valid JSON"),
        ("[]", 0, "native", "must be a JSON object"),
        (json.dumps({"kv_connector": "NixlConnector"}), 0, "native",
         "kv_connector 'NixlConnector' is not available"),
        (json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_producer",
                     "kv_connector_extra_config": {"cpu_bytes_to_use": 1}}), 0, "native",
         "kv_role must be 'kv_both'"),
        (connector(), 0, "native", "cpu_bytes_to_use must be a positive number of bytes"),
        (connector(cpu_bytes_to_use=-1), 0, "native", "cpu_bytes_to_use must be a positive"),
        (connector(cpu_bytes_to_use=True), 0, "native", "cpu_bytes_to_use must be a positive"),
        (connector(cpu_bytes_to_use=1, block_size=64), 0, "native",
         "key 'block_size' is not supported"),
        (connector(cpu_bytes_to_use=1, eviction_policy="arc"), 0, "native",
         "eviction_policy 'arc' is not supported"),
        (connector(cpu_bytes_to_use=1, spec_name="Other"), 0, "native", "spec_name must be one of"),
        (connector(cpu_bytes_to_use=1, secondary_tiers=[fs()]), 0, "native",
         "secondary_tiers need spec_name 'TieringOffloadingSpec'"),
        (connector(cpu_bytes_to_use=1, spec_name="TieringOffloadingSpec",
                   secondary_tiers=[fs(), fs()]), 0, "native", "at most one tier"),
        (connector(cpu_bytes_to_use=1, spec_name="TieringOffloadingSpec",
                   secondary_tiers=[{"type": "obj", "root_dir": "x", "max_bytes": 1}]),
         0, "native", "tier type 'obj' is not available"),
        (connector(cpu_bytes_to_use=1, spec_name="TieringOffloadingSpec",
                   secondary_tiers=[fs(max_bytes=None)]), 0, "native", "max_bytes"),
        (connector(cpu_bytes_to_use=1, spec_name="TieringOffloadingSpec",
                   secondary_tiers=[fs(root="")]), 0, "native", "needs root_dir"),
        (connector(cpu_bytes_to_use=1, spec_name="TieringOffloadingSpec",
                   secondary_tiers=[fs(n_read_threads=4)]), 0, "native",
         "tier key 'n_read_threads' is not supported"),
        ("", 1, "lmcache", "--kv-offloading-backend lmcache: LMCache is not part of Tandem"),
        ("", 1, "mooncake", "--kv-offloading-backend: must be one of native, lmcache"),
        ("", float("nan"), "native", "--kv-offloading-size: must be a finite number"),
        ("", -1, "native", "--kv-offloading-size: must be a finite number"),
    ],
)  # fmt: skip
def test_what_tandem_does_not_honour_is_refused_naming_it(config, size, backend, message):
    with pytest.raises(ValueError, match="^" + "|".join(["--kv-"])) as error:
        parse_offloading(config, size, backend)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_worker_given_vllm_s_flags_has_tandem_s_tier_settings(tmp_path):
    config = WorkerConfig(model="m", kv_offloading_size=0.25)
    assert (config.kv_offload_cpu_bytes, config.kv_offload_dir) == (str(GIB // 4), "")
    disk = connector(cpu_bytes_to_use=GIB, spec_name="TieringOffloadingSpec",
                     secondary_tiers=[fs(str(tmp_path), 2 * GIB)])  # fmt: skip
    config = WorkerConfig(model="m", kv_transfer_config=disk)
    assert (config.kv_offload_cpu_bytes, config.kv_offload_dir, config.kv_offload_disk_bytes) == (
        str(GIB),
        str(tmp_path),
        str(2 * GIB),
    )
    # One shape from then on: a copy with another field checks Tandem's settings only.
    assert dataclasses.replace(config, model="n").kv_offload_dir == str(tmp_path)
    with pytest.raises(ValueError, match="cannot be combined with --kv-offload-cpu-bytes"):
        WorkerConfig(model="m", kv_offloading_size=1, kv_offload_cpu_bytes="1GiB")
    with pytest.raises(ValueError, match="kv_connector 'P2pNcclConnector' is not available"):
        WorkerConfig(model="m", kv_transfer_config='{"kv_connector": "P2pNcclConnector"}')
