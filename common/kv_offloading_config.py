"""vLLM's KV offloading settings, read into Tandem's offload tiers (`OffloadTiers`: the
host-memory tier's bytes, then the disk tier's folder and bytes), so a vLLM user's flags
work unchanged on a worker:

    --kv-offloading-size 4 [--kv-offloading-backend native]
        vLLM's shortcut: a 4 GiB host tier (`lmcache` is refused: not part of Tandem)
    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": 4294967296}}'
        the same, as vLLM's connector config
    ..."kv_connector_extra_config": {"cpu_bytes_to_use": 4294967296,
        "spec_name": "TieringOffloadingSpec",
        "secondary_tiers": [{"type": "fs", "root_dir": "/var/kv", "max_bytes": 68719476736}]}
        a disk tier behind it (vLLM's file-system tier; `max_bytes`, its budget, is Tandem's
        own: vLLM's `fs` tier has none, Tandem's disk tier is LRU within one)

As in vLLM, `--kv-offloading-size` fills the connector config's `cpu_bytes_to_use` (and
names the OffloadingConnector), and the connector config may be given alone. Keys vLLM
has that Tandem does not honour (another eviction policy, another offload block size, a
store threshold) are refused, naming the key, rather than silently ignored. Tandem's own
flags (`--kv-offload-cpu-bytes`, `--kv-offload-dir`, `--kv-offload-disk-bytes`) say the
same; the worker takes one way or the other (`services/worker/config.py`). KV transfer
between prefill and decode workers needs no connector here: workers started with
`--role prefill` / `--role decode` do it (pull, UCX, UCX between layouts). Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SIZE_FLAG = "--kv-offloading-size"
BACKEND_FLAG = "--kv-offloading-backend"
CONFIG_FLAG = "--kv-transfer-config"
BACKENDS = ("native", "lmcache")
CONNECTOR = "OffloadingConnector"
SPECS = ("CPUOffloadingSpec", "TieringOffloadingSpec")
EXTRA_KEYS = ("cpu_bytes_to_use", "spec_name", "secondary_tiers", "eviction_policy")
TIER_KEYS = ("type", "root_dir", "max_bytes")
GIB = 1 << 30


@dataclass(frozen=True)
class OffloadTiers:
    """What the tiers hold: host bytes, then a disk folder and its bytes ("" and 0: none)."""

    cpu_bytes: int
    disk_dir: str = ""
    disk_bytes: int = 0


def parse_offloading(
    transfer_config: str, size_gib: float = 0.0, backend: str = "native"
) -> OffloadTiers | None:
    """The tiers vLLM's settings ask for (None: no offloading). Raises ValueError with one
    line naming the flag and the field."""
    if backend not in BACKENDS:
        raise ValueError(f"{BACKEND_FLAG}: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not size_gib >= 0 or size_gib == float("inf"):
        raise ValueError(f"{SIZE_FLAG}: must be a finite number of GiB >= 0, got {size_gib!r}")
    config = _load(transfer_config) if transfer_config.strip() else None
    if size_gib > 0:
        if backend == "lmcache":
            raise ValueError(
                f"{BACKEND_FLAG} lmcache: LMCache is not part of Tandem; use native (the "
                "host-memory tier, and a disk tier behind it: --kv-transfer-config)"
            )
        extra = dict((config or {}).get("kv_connector_extra_config") or {})
        extra["cpu_bytes_to_use"] = int(size_gib * GIB)
        config = {**(config or {}), "kv_connector": CONNECTOR, "kv_role": "kv_both",
                  "kv_connector_extra_config": extra}  # fmt: skip
    if config is None:
        return None
    return _tiers(config)


def _load(text: str) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{CONFIG_FLAG}: not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FLAG}: must be a JSON object")
    return config


def _tiers(config: dict[str, Any]) -> OffloadTiers:
    connector = config.get("kv_connector")
    if connector != CONNECTOR:
        raise ValueError(
            f"{CONFIG_FLAG}: kv_connector {connector!r} is not available; Tandem's is "
            f"{CONNECTOR!r} (KV offloading to host memory and disk). KV between prefill "
            "and decode workers needs none: start them with --role prefill / --role decode"
        )
    role = config.get("kv_role", "kv_both")
    if role != "kv_both":
        raise ValueError(f"{CONFIG_FLAG}: kv_role must be 'kv_both' for {CONNECTOR}, got {role!r}")
    extra = _object(config.get("kv_connector_extra_config") or {}, EXTRA_KEYS,
                    "kv_connector_extra_config")  # fmt: skip
    if extra.get("eviction_policy", "lru") != "lru":
        raise ValueError(
            f"{CONFIG_FLAG}: eviction_policy {extra['eviction_policy']!r} is not supported "
            "(Tandem's tiers are LRU)"
        )
    cpu_bytes = _positive_int(extra.get("cpu_bytes_to_use"), "cpu_bytes_to_use")
    spec = extra.get("spec_name", SPECS[0])
    if spec not in SPECS:
        raise ValueError(
            f"{CONFIG_FLAG}: spec_name must be one of {', '.join(SPECS)}, got {spec!r}"
        )
    tiers = extra.get("secondary_tiers") or []
    if tiers and spec != "TieringOffloadingSpec":
        raise ValueError(f"{CONFIG_FLAG}: secondary_tiers need spec_name 'TieringOffloadingSpec'")
    if not isinstance(tiers, list) or len(tiers) > 1:
        raise ValueError(f"{CONFIG_FLAG}: secondary_tiers must be a list of at most one tier")
    if not tiers:
        return OffloadTiers(cpu_bytes)
    return OffloadTiers(cpu_bytes, *_disk(tiers[0]))


def _disk(tier: Any) -> tuple[str, int]:
    tier = _object(tier, TIER_KEYS, "secondary tier")
    if tier.get("type") != "fs":
        raise ValueError(
            f"{CONFIG_FLAG}: secondary tier type {tier.get('type')!r} is not available; "
            "Tandem's is 'fs' (a folder on local disk)"
        )
    root = tier.get("root_dir")
    if not isinstance(root, str) or not root:
        raise ValueError(f"{CONFIG_FLAG}: the fs tier needs root_dir, a folder")
    return root, _positive_int(tier.get("max_bytes"), "max_bytes (the fs tier's budget)")


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 2**63:
        raise ValueError(f"{CONFIG_FLAG}: {name} must be a positive number of bytes, got {value!r}")
    return int(value)


def _object(value: Any, keys: tuple[str, ...], what: str) -> dict[str, Any]:
    """`value`, a JSON object of only the `keys` Tandem reads."""
    if not isinstance(value, dict):
        raise ValueError(f"{CONFIG_FLAG}: {what} must be a JSON object")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(
            f"{CONFIG_FLAG}: {what} key {unknown[0]!r} is not supported (Tandem reads "
            f"{', '.join(keys)})"
        )
    return value
