"""The offload tiers' budgets: `--kv-offload-cpu-bytes` (host memory), `--kv-offload-dir`
and `--kv-offload-disk-bytes` (disk). A zero budget turns its tier off. Checks only; no
I/O (the disk tier makes its folder when it starts)."""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.kv_offload.disk_format import HEADER_BYTES

MAX_BYTES = 1 << 50  # 1 PiB: anything larger is a typo (a unit too many)


@dataclass(frozen=True)
class TierConfig:
    cpu_bytes: int = 0
    disk_dir: str = ""
    disk_bytes: int = 0

    def __post_init__(self) -> None:
        for flag, value in (
            ("--kv-offload-cpu-bytes", self.cpu_bytes),
            ("--kv-offload-disk-bytes", self.disk_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{flag} must be an integer number of bytes, got {value!r}")
            if not 0 <= value <= MAX_BYTES:
                raise ValueError(f"{flag} must be in [0, {MAX_BYTES}] (0: off), got {value}")
        if not isinstance(self.disk_dir, str) or "\0" in self.disk_dir:
            raise ValueError(f"--kv-offload-dir must be a folder path, got {self.disk_dir!r}")
        if self.disk_bytes and not self.disk_dir:
            raise ValueError("--kv-offload-disk-bytes needs --kv-offload-dir (the folder)")
        if self.disk_dir and not self.disk_bytes:
            raise ValueError("--kv-offload-dir needs --kv-offload-disk-bytes > 0 (its budget)")

    @property
    def cpu_enabled(self) -> bool:
        return self.cpu_bytes > 0

    @property
    def disk_enabled(self) -> bool:
        return self.disk_bytes > 0

    def check_block_fits(self, block_bytes: int) -> None:
        """Each budget that is on holds one block at least (on disk, a block's file: its
        header too); raises naming the flag and the least it may be."""
        for flag, budget, need in (
            ("--kv-offload-cpu-bytes", self.cpu_bytes, block_bytes),
            ("--kv-offload-disk-bytes", self.disk_bytes, HEADER_BYTES + block_bytes),
        ):
            if 0 < budget < need:
                raise ValueError(
                    f"{flag} {budget} holds no block: 0 (off) or at least {need} bytes"
                )
