"""Retention in the disk tier (issue 45, `kv_retention_s`): a retained file is dropped only
when no unretained file is left to make room, earliest deadline first; its deadline is in
its name, so it survives a restart; a later deadline renames the file, an earlier one
changes nothing; after the deadline it is an ordinary LRU file. Real files under tmp_path,
the test's clock; files without a deadline (written before retention existed) are read
as ever."""

from __future__ import annotations

import torch

from services.worker.kv_offload.disk_tier import DiskTier
from tests.kv_offload_blocks import ROOT, block, identity, key
from tests.unit.test_kv_offload_disk import FILE_BYTES, block_files


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def tier(folder, blocks: int, clock: Clock) -> DiskTier:
    return DiskTier(folder, blocks * FILE_BYTES + FILE_BYTES // 2, identity(), clock=clock)


def test_retained_files_are_dropped_only_when_nothing_else_is_left(tmp_path):
    clock = Clock()
    disk = tier(tmp_path, 3, clock)
    disk.put(key(0), ROOT, block(0), retain_until=clock.now + 100)
    disk.put(key(1), ROOT, block(1))
    disk.put(key(2), ROOT, block(2), retain_until=clock.now + 50)
    assert [e.key for e in disk.put(key(3), ROOT, block(3))] == [key(1)]
    assert [e.key for e in disk.put(key(4), ROOT, block(4))] == [key(3)]
    # A retained save still pushes out the unretained file first.
    evicted = disk.put(key(5), ROOT, block(5), retain_until=clock.now + 200)
    assert [e.key for e in evicted] == [key(4)]
    assert disk.keys() == [key(2), key(0), key(5)]  # by deadline
    assert torch.equal(disk.get(key(0), ROOT), block(0))


def test_only_when_every_file_is_retained_the_earliest_deadline_goes(tmp_path):
    clock = Clock()
    disk = tier(tmp_path, 2, clock)
    disk.put(key(0), ROOT, block(0), retain_until=clock.now + 100)
    disk.put(key(1), ROOT, block(1), retain_until=clock.now + 50)
    evicted = disk.put(key(2), ROOT, block(2))
    assert [e.key for e in evicted] == [key(1)]
    assert [e.key for e in disk.put(key(3), ROOT, block(3))] == [key(2)]  # unretained first
    assert disk.contains(key(0))


def test_the_deadline_is_in_the_name_and_survives_a_restart(tmp_path):
    clock = Clock()
    disk = tier(tmp_path, 3, clock)
    disk.put(key(0), ROOT, block(0), retain_until=clock.now + 99.2)
    disk.put(key(1), ROOT, block(1))
    names = {p.name for p in block_files(disk)}
    deadline = int(clock.now) + 100  # whole seconds, rounded up
    assert f"{key(0).block_hash.hex()}-0-r{deadline}.kv" in names
    assert f"{key(1).block_hash.hex()}-0.kv" in names  # the old name: no deadline
    again = tier(tmp_path, 3, clock)  # a restart
    assert again.retained_until(key(0)) == deadline
    assert again.retained_until(key(1)) == 0
    again.put(key(2), ROOT, block(2))
    assert [e.key for e in again.put(key(3), ROOT, block(3))] == [key(1)]
    assert torch.equal(again.get(key(0), ROOT), block(0))


def test_a_later_deadline_renames_the_file_and_an_earlier_one_does_not(tmp_path):
    clock = Clock()
    disk = tier(tmp_path, 3, clock)
    disk.put(key(0), ROOT, block(0), retain_until=clock.now + 10)
    disk.retain(key(0), clock.now + 5)
    assert disk.retained_until(key(0)) == int(clock.now) + 10
    disk.put(key(0), ROOT, block(0), retain_until=clock.now + 60)  # saved again: extended
    assert disk.retained_until(key(0)) == int(clock.now) + 60
    (path,) = block_files(disk)
    assert path.name.endswith(f"-r{int(clock.now) + 60}.kv")
    assert torch.equal(disk.get(key(0), ROOT), block(0))
    assert disk.retain(key(9), clock.now + 60) == [] and not disk.contains(key(9))


def test_after_its_deadline_a_file_is_an_ordinary_lru_file_in_its_place(tmp_path):
    clock = Clock()
    disk = tier(tmp_path, 3, clock)
    disk.put(key(0), ROOT, block(0), retain_until=clock.now + 10)  # the oldest use
    disk.put(key(1), ROOT, block(1))
    disk.put(key(2), ROOT, block(2))
    clock.now += 11
    assert [e.key for e in disk.put(key(3), ROOT, block(3))] == [key(0)]
    # Expired across a restart too: read as an LRU file by its mtime.
    disk.put(key(4), ROOT, block(4), retain_until=clock.now + 5)  # pushes out key(1)
    clock.now += 6
    again = tier(tmp_path, 3, clock)
    assert again.keys()[0] == key(2)
    assert [e.key for e in again.put(key(5), ROOT, block(5))] == [key(2)]


def test_two_names_of_one_block_leave_one_after_a_restart(tmp_path):
    clock = Clock()
    disk = tier(tmp_path, 3, clock)
    disk.put(key(0), ROOT, block(0), retain_until=clock.now + 10)
    (path,) = block_files(disk)
    twin = path.with_name(f"{key(0).block_hash.hex()}-0.kv")
    twin.write_bytes(path.read_bytes())  # as a crash between two renames could leave
    again = tier(tmp_path, 3, clock)
    assert len(block_files(again)) == 1 and len(again) == 1
    assert torch.equal(again.get(key(0), ROOT), block(0))
