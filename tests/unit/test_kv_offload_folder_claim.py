"""Disk-tier folders claimed by one live tier at a time (`folder_claim`): two workers of one
identity given one `--kv-offload-dir` each get a folder and a budget of their own; a claim
let go (a worker's exit) is taken again with its files. Real files and locks."""

import os
import subprocess
import sys

from services.worker.kv_offload.disk_format import HEADER_BYTES
from services.worker.kv_offload.disk_tier import DiskTier
from services.worker.kv_offload.folder_claim import CLAIM_FILE, FolderClaim
from tests.kv_offload_blocks import BLOCK_BYTES, ROOT, block, identity, key

BUDGET = 4 * (HEADER_BYTES + BLOCK_BYTES)


def test_two_live_tiers_of_one_identity_never_share_a_folder(tmp_path):
    first = DiskTier(tmp_path, BUDGET, identity(), claim=True)
    second = DiskTier(tmp_path, BUDGET, identity(), claim=True)
    assert first.folder.name + ".1" == second.folder.name
    first.put(key(1), ROOT, block(1))
    second.put(key(2), ROOT, block(2))
    assert first.keys() == [key(1)] and second.keys() == [key(2)]
    other = DiskTier(tmp_path, BUDGET, identity(tp_rank=1, tp_size=2), claim=True)
    assert other.folder.parent == tmp_path and "." not in other.folder.name  # its own
    # The first lets go (its worker exits): a restart takes its folder and its files,
    # and the claim file is no block (nothing unknown is indexed or deleted).
    first.close()
    again = DiskTier(tmp_path, BUDGET, identity(), claim=True)
    assert again.folder == first.folder and again.keys() == [key(1)]
    assert (again.folder / CLAIM_FILE).exists()
    for tier in (second, other, again):
        tier.close()


def test_a_killed_process_s_claim_is_free_again(tmp_path):
    """A process holding a claim is SIGKILLed: the kernel drops its lock with it."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from services.worker.kv_offload.folder_claim import FolderClaim\n"
        "FolderClaim.first_free(Path(sys.argv[1]))\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    folder = tmp_path / "identity"
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE, text=True,
        cwd=os.getcwd(),
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "held"
        taken = FolderClaim.first_free(folder)
        assert taken.folder.name == "identity.1"  # the child holds the first
        taken.release()
        child.kill()
        child.wait()
        free = FolderClaim.first_free(folder)
        assert free.folder == folder
        free.release()
    finally:
        child.kill()
