"""The disk tier shared by two threads: whatever the interleaving, every hit is the
right block's bytes, the index matches what the tier holds, and the budget holds. The
checks are the same for every interleaving (no sleeps, no timing)."""

import sys
import threading

import structlog
import torch

from services.worker.kv_offload.disk_format import HEADER_BYTES, parse_name
from services.worker.kv_offload.disk_tier import DiskTier
from tests.kv_offload_blocks import BLOCK_BYTES, ROOT, block, identity, key

KEYS = 12
ROUNDS = 6
INDEX = {key(i): i for i in range(KEYS)}


def run_two_threads(put, get) -> list[str]:
    """Each thread puts and reads back overlapping keys in its own order; returns every
    wrong byte served (none expected)."""
    start = threading.Barrier(2)
    wrong: list[str] = []

    def worker(offset: int, step: int) -> None:
        start.wait()
        out = torch.empty(BLOCK_BYTES, dtype=torch.uint8)
        for round_ in range(ROUNDS):
            for n in range(KEYS):
                i = (offset + step * n + round_) % KEYS
                put(i)
                for j in (i, (i + 5) % KEYS):
                    got = get(j, out)
                    if got is not None and not torch.equal(got, block(j)):
                        wrong.append(f"key {j}")

    threads = [threading.Thread(target=worker, args=args) for args in ((0, 1), (7, 5))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: more interleavings
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    return wrong


def test_disk_tier_shared_by_two_threads_stays_consistent(tmp_path):
    file_bytes = HEADER_BYTES + BLOCK_BYTES
    disk = DiskTier(tmp_path, 5 * file_bytes, identity())
    with structlog.testing.capture_logs() as logs:
        wrong = run_two_threads(
            lambda i: disk.put(key(i), ROOT, block(i)),
            lambda j, out: disk.get(key(j), ROOT, out=out),
        )
    assert wrong == []
    assert [e for e in logs if e["log_level"] == "warning"] == []  # no false "bad file"
    assert disk.take_dropped() == []
    files = [p for p in disk.folder.rglob("*") if p.is_file()]
    on_disk = {parse_name(p.parent.name, p.name)[0] for p in files}
    held = disk.keys()
    assert on_disk == set(held) and len(held) == len(files) == 5  # no temp files left
    assert disk.bytes_used == sum(p.stat().st_size for p in files) == 5 * file_bytes
    for k in held:
        assert torch.equal(disk.get(k, ROOT), block(INDEX[k]))
    assert DiskTier(tmp_path, 5 * file_bytes, identity()).keys() == disk.keys()
