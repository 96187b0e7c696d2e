"""The disk offload tier: one file per block, LRU under a byte budget, kept across a
restart; a truncated, corrupt or foreign file is a miss, logged once, deleted, never
served. Real files under tmp_path."""

import os
import struct
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import structlog
import torch

from services.worker.kv_offload import disk_tier as disk_tier_module
from services.worker.kv_offload.disk_format import HEADER_BYTES
from services.worker.kv_offload.disk_tier import DiskTier
from tests.kv_offload_blocks import BLOCK_BYTES, OTHER_ROOT, ROOT, block, identity, key

FILE_BYTES = HEADER_BYTES + BLOCK_BYTES


def tier(folder: Path, blocks: int, **changes) -> DiskTier:
    return DiskTier(folder, blocks * FILE_BYTES + FILE_BYTES // 2, identity(**changes))


def block_files(disk: DiskTier) -> list[Path]:
    return sorted(p for p in disk.folder.rglob("*") if p.is_file())


def bad_file_logs(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "kv_offload_bad_file"]


def test_put_beyond_budget_evicts_least_recently_used_and_get_refreshes(tmp_path):
    disk = tier(tmp_path, 3)
    assert disk.capacity_blocks == 3 and disk.enabled
    for i in range(3):
        assert disk.put(key(i), ROOT, block(i)) == []
    assert torch.equal(disk.get(key(0), ROOT), block(0))  # 0 is now the most recent
    evicted = disk.put(key(3), ROOT, block(3))
    assert [(e.key, e.nbytes, e.reason) for e in evicted] == [(key(1), FILE_BYTES, "lru")]
    assert disk.keys() == [key(2), key(0), key(3)]
    assert disk.bytes_used == 3 * FILE_BYTES == sum(p.stat().st_size for p in block_files(disk))
    assert not disk.contains(key(1)) and disk.get(key(1), ROOT) is None
    assert disk.put(key(0), ROOT, block(0)) == []  # held: only refreshed
    assert [e.key for e in disk.put(key(4), ROOT, block(4))] == [key(2)]
    assert len(block_files(disk)) == 3


def test_file_layout_is_the_documented_header_then_the_payload(tmp_path):
    disk = tier(tmp_path, 2)
    disk.put(key(5, group=3), ROOT, block(5))
    (path,) = block_files(disk)
    assert path.name == f"{key(5).block_hash.hex()}-3.kv"
    assert path.parent.name == key(5).block_hash.hex()[:2]
    assert path.parent.parent.name == identity().fingerprint.hex()[:16]
    raw = path.read_bytes()
    assert len(raw) == FILE_BYTES == 128 + BLOCK_BYTES
    assert raw[0:8] == b"TANDEMKV"
    assert struct.unpack_from("<II", raw, 8) == (1, 3)  # version, group
    assert raw[16:48] == identity().fingerprint
    assert raw[48:80] == key(5).block_hash
    assert raw[80:112] == ROOT
    assert struct.unpack_from("<Q", raw, 112) == (BLOCK_BYTES,)
    assert raw[120:124] == bytes(4)
    assert struct.unpack_from("<I", raw, 124) == (zlib.crc32(raw[128:], zlib.crc32(raw[:124])),)
    assert raw[128:] == block(5).numpy().tobytes()


@pytest.mark.parametrize(
    "make",
    [
        lambda: (
            torch.tensor([float("nan"), -0.0, float("inf"), 1e-45])
            .repeat(BLOCK_BYTES // 16)
            .reshape(4, -1)
        ),
        lambda: torch.randn(BLOCK_BYTES // 2, generator=torch.Generator().manual_seed(1)).to(
            torch.bfloat16
        ),
        lambda: torch.randn(BLOCK_BYTES, generator=torch.Generator().manual_seed(2)).to(
            torch.float8_e4m3fn
        ),
    ],
    ids=["float32", "bfloat16", "fp8"],
)
def test_blocks_round_trip_bit_exactly_whatever_their_dtype(tmp_path, make):
    source = make()
    disk = tier(tmp_path, 2)
    disk.put(key(0), ROOT, source)
    assert torch.equal(disk.get(key(0), ROOT), source.reshape(-1).view(torch.uint8))
    back = torch.empty_like(source)
    assert disk.get(key(0), ROOT, out=back) is back
    assert torch.equal(back.view(torch.uint8), source.view(torch.uint8))


def test_a_restarted_tier_serves_its_blocks_in_the_same_lru_order(tmp_path):
    disk = tier(tmp_path, 4)
    for i in range(4):
        disk.put(key(i, group=i % 2), ROOT, block(i))
    disk.get(key(1, group=1), ROOT)
    disk.get(key(0), ROOT)
    order = [key(2), key(3, group=1), key(1, group=1), key(0)]
    assert disk.keys() == order
    restarted = tier(tmp_path, 4)  # same folder, same identity: a worker restart
    assert restarted.keys() == order and restarted.bytes_used == 4 * FILE_BYTES
    for i in range(4):
        assert torch.equal(restarted.get(key(i, group=i % 2), ROOT), block(i))
    # the gets refreshed in order 0..3; a put into the full tier evicts the oldest: 0
    assert [e.key for e in restarted.put(key(9), ROOT, block(9))] == [key(0)]


def test_the_lru_order_survives_a_restart_even_when_the_clock_stands_still(tmp_path, monkeypatch):
    """Each write and hit stamps a strictly increasing mtime, whatever the wall clock."""
    monkeypatch.setattr(disk_tier_module, "time", SimpleNamespace(time_ns=lambda: 10**18))
    disk = tier(tmp_path, 4)
    for i in (3, 1, 2, 0):
        disk.put(key(i), ROOT, block(i))
    disk.get(key(1), ROOT)
    assert tier(tmp_path, 4).keys() == [key(3), key(2), key(0), key(1)]


def test_the_budget_holds_at_start_when_the_folder_has_more(tmp_path):
    disk = tier(tmp_path, 5)
    for i in range(5):
        disk.put(key(i), ROOT, block(i))
    smaller = tier(tmp_path, 3)
    assert smaller.keys() == [key(2), key(3), key(4)]  # the two oldest went
    assert len(block_files(smaller)) == 3 and smaller.bytes_used == 3 * FILE_BYTES


def test_stray_temporary_files_are_removed_at_start(tmp_path):
    disk = tier(tmp_path, 4)
    disk.put(key(0), ROOT, block(0))
    (real,) = block_files(disk)
    torn = real.parent / ".killed-mid-write.tmp"  # a worker killed during a write
    torn.write_bytes(real.read_bytes()[: HEADER_BYTES + 10])
    (disk.folder / "7f").mkdir()
    (disk.folder / "7f" / ".other.tmp").write_bytes(b"x")
    with structlog.testing.capture_logs() as logs:
        restarted = tier(tmp_path, 4)
    assert block_files(restarted) == [real]
    assert restarted.keys() == [key(0)]
    (indexed,) = [e for e in logs if e["event"] == "kv_offload_disk_indexed"]
    assert indexed["temporaries_removed"] == 2 and indexed["blocks"] == 1
    assert torch.equal(restarted.get(key(0), ROOT), block(0))


def corrupt_truncate(path: Path) -> None:
    os.truncate(path, FILE_BYTES - 100)


def corrupt_payload(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + BLOCK_BYTES // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def flip_header(offset: int):
    def corrupt(path: Path) -> None:
        raw = bytearray(path.read_bytes())
        raw[offset] ^= 0x80
        path.write_bytes(bytes(raw))

    return corrupt


HEADER_FIELDS = {  # an offset inside each field of the header, and the miss's reason
    "magic": (3, "magic"),
    "version": (8, "format version"),
    "group": (12, "another block"),
    "identity": (30, "identity"),
    "hash": (60, "another block"),
    "root": (100, "salted root"),
    "length": (113, "payload length"),
    "reserved": (122, "checksum"),
    "checksum": (126, "checksum"),
}


@pytest.mark.parametrize(
    "corrupt, reason",
    [(corrupt_truncate, "truncated"), (corrupt_payload, "checksum")]
    + [(flip_header(offset), reason) for offset, reason in HEADER_FIELDS.values()],
    ids=["truncated", "payload_byte"] + [f"header_{name}" for name in HEADER_FIELDS],
)
def test_a_damaged_file_is_a_miss_logged_once_deleted_and_never_served(tmp_path, corrupt, reason):
    disk = tier(tmp_path, 4)
    disk.put(key(0), ROOT, block(0))
    disk.put(key(1), ROOT, block(1))
    damaged = disk.folder / key(0).block_hash.hex()[:2] / f"{key(0).block_hash.hex()}-0.kv"
    corrupt(damaged)
    with structlog.testing.capture_logs() as logs:
        assert disk.get(key(0), ROOT) is None
        assert disk.get(key(0), ROOT) is None
    (logged,) = bad_file_logs(logs)
    assert logged["path"] == str(damaged) and logged["log_level"] == "warning"
    assert reason in logged["reason"]
    assert not damaged.exists() and disk.keys() == [key(1)]
    assert [e.key for e in disk.take_dropped()] == [key(0)]
    assert torch.equal(disk.get(key(1), ROOT), block(1))  # its neighbour is unharmed
    assert disk.bytes_used == FILE_BYTES


def test_a_file_torn_before_a_restart_is_dropped_at_start_logged_once(tmp_path):
    disk = tier(tmp_path, 4)
    disk.put(key(0), ROOT, block(0))
    (path,) = block_files(disk)
    corrupt_truncate(path)
    with structlog.testing.capture_logs() as logs:
        restarted = tier(tmp_path, 4)
        assert restarted.get(key(0), ROOT) is None
    assert len(bad_file_logs(logs)) == 1 and not path.exists() and restarted.keys() == []


def test_a_block_stored_under_another_salted_root_is_never_served(tmp_path):
    """cache_salt isolation: same block hash, another root -> miss, logged, file gone."""
    disk = tier(tmp_path, 4)
    disk.put(key(0), ROOT, block(0))
    with structlog.testing.capture_logs() as logs:
        assert disk.get(key(0), OTHER_ROOT) is None
        assert disk.get(key(0), ROOT) is None  # deleted: not served to anyone again
    (logged,) = bad_file_logs(logs)
    assert "salted root" in logged["reason"]
    assert block_files(disk) == [] and disk.keys() == []


@pytest.mark.parametrize(
    "other",
    [
        dict(tp_rank=1, tp_size=2),  # another tensor-parallel rank
        dict(num_slots=4, block_size=2),  # another geometry, the same bytes per block
        dict(dtype="torch.int32"),  # another dtype, the same bytes
        dict(pp_rank=1, pp_size=2),  # another pipeline stage
        dict(model="another-model"),
    ],
    ids=["tp_rank", "geometry", "dtype", "pp_stage", "model"],
)
def test_a_file_of_another_identity_is_foreign_a_miss_logged_once(tmp_path, other):
    mine = tier(tmp_path, 4)
    mine.put(key(0), ROOT, block(0))
    theirs = tier(tmp_path, 4, **other)
    assert theirs.folder != mine.folder and theirs.keys() == []  # a folder per identity
    # a file misplaced into the other identity's folder (copied by hand, a prefix clash)
    (source,) = block_files(mine)
    target = theirs.folder / source.relative_to(mine.folder)
    target.parent.mkdir(parents=True)
    target.write_bytes(source.read_bytes())
    theirs = tier(tmp_path, 4, **other)  # restarted: indexes the misplaced file
    assert theirs.keys() == [key(0)]
    with structlog.testing.capture_logs() as logs:
        assert theirs.get(key(0), ROOT) is None
        assert theirs.get(key(0), ROOT) is None
    (logged,) = bad_file_logs(logs)
    assert "identity" in logged["reason"] and not target.exists()
    assert torch.equal(mine.get(key(0), ROOT), block(0))  # the owner's file is untouched


def test_a_file_of_another_block_size_is_dropped_at_start(tmp_path):
    small = DiskTier(tmp_path, 10 * FILE_BYTES, identity(block_bytes=BLOCK_BYTES // 2))
    small.put(key(0), ROOT, block(0, BLOCK_BYTES // 2))
    (source,) = block_files(small)
    mine = tier(tmp_path, 4)
    target = mine.folder / source.relative_to(small.folder)
    target.parent.mkdir(parents=True)
    target.write_bytes(source.read_bytes())
    with structlog.testing.capture_logs() as logs:
        restarted = tier(tmp_path, 4)
    assert restarted.keys() == [] and not target.exists() and len(bad_file_logs(logs)) == 1


def test_ranks_sharing_a_folder_keep_their_own_blocks(tmp_path):
    ranks = [tier(tmp_path, 2, tp_rank=r, tp_size=2) for r in range(2)]
    for rank, disk in enumerate(ranks):
        disk.put(key(0), ROOT, block(10 + rank))  # one hash, each rank's head slice
    for rank, disk in enumerate(ranks):
        assert torch.equal(disk.get(key(0), ROOT), block(10 + rank))


def test_a_file_deleted_from_outside_is_a_miss_logged_once(tmp_path):
    disk = tier(tmp_path, 2)
    disk.put(key(0), ROOT, block(0))
    block_files(disk)[0].unlink()
    with structlog.testing.capture_logs() as logs:
        assert disk.get(key(0), ROOT) is None
        assert disk.get(key(0), ROOT) is None
    assert len(bad_file_logs(logs)) == 1 and disk.keys() == []


def test_a_failed_write_stores_nothing_and_is_logged_once(tmp_path, monkeypatch):
    disk = tier(tmp_path, 2)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_tier_module.tempfile, "mkstemp", disk_full)
    with structlog.testing.capture_logs() as logs:
        assert disk.put(key(0), ROOT, block(0)) == []
        assert disk.put(key(1), ROOT, block(1)) == []
    assert [e["event"] for e in logs] == ["kv_offload_disk_write_failed"]
    assert disk.keys() == [] and block_files(disk) == []


@pytest.mark.parametrize("budget", [0, FILE_BYTES - 1])
def test_a_budget_below_one_file_is_a_disabled_tier(tmp_path, budget):
    disk = DiskTier(tmp_path / "kv", budget, identity())
    assert not disk.enabled and not (tmp_path / "kv").exists()
    assert disk.put(key(0), ROOT, block(0)) == []
    assert disk.get(key(0), ROOT) is None and disk.keys() == [] and disk.bytes_used == 0


def test_remove_deletes_the_file(tmp_path):
    disk = tier(tmp_path, 2)
    disk.put(key(0), ROOT, block(0))
    assert disk.remove(key(0)) and not disk.remove(key(0))
    assert block_files(disk) == [] and disk.get(key(0), ROOT) is None


def test_a_block_of_the_wrong_size_is_refused(tmp_path):
    disk = tier(tmp_path, 2)
    with pytest.raises(ValueError, match="a block is 1024 bytes"):
        disk.put(key(0), ROOT, torch.zeros(BLOCK_BYTES - 4, dtype=torch.uint8))
    assert block_files(disk) == []
