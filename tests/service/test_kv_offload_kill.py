"""A worker killed in the middle of a disk-tier write loses nothing a later request is
served from (issue 45): the fault hook (`services/worker/kv_offload/fault_hooks.py`)
stops the 5th block write after its header and half its payload, the test SIGKILLs the
worker right then and starts it again over the same folder. The half-written file (a
temporary, never under the block's name) is removed at start and never served; the
blocks written before it are found and served; every output is HF-exact; no block is
left held."""

from __future__ import annotations

import signal
from pathlib import Path

from common.prefix_hash import extend_block_hashes, root_hash
from tests.fault_injection import wait_for, wait_healthy_pools
from tests.hf_reference import hf_greedy
from tests.stack_client import generate, greedy_request, pool_stats, start_stack, wait_until_idle

BLOCK = 16
SALT = "kill-during-write"  # a known deployment salt: the test can name a block's hash


def salted(prompt: list[int], max_tokens: int):
    request = greedy_request(prompt, max_tokens)
    request.cache_salt = "offload"
    return request


def test_a_worker_killed_mid_disk_write_serves_only_whole_files_after_a_restart(
    tiny_llama_dir, tmp_path
):
    disk, marker = tmp_path / "kv", tmp_path / "stalled"
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # tiny llama: layers, K/V, slots, heads, dim
    args = {
        "both": [
            *("--max-model-len", "160", "--num-blocks", "10", "--block-size", str(BLOCK)),
            *("--kv-offload-cpu-bytes", str(4 * block_bytes)),
            *("--kv-offload-dir", str(disk), "--kv-offload-disk-bytes", "4MiB"),
        ],
        "scheduler": ["--prefix-cache-salt", SALT],
    }
    # Writes 1-4: the first turn's 4 blocks (pushed out of the 4-block host tier by the
    # first flood request); write 5, the first flood request's first block out: stalled.
    env = {"TANDEM_FAULT_DISK_WRITE_STALL": f"{marker}:5"}
    stack = start_stack(
        tiny_llama_dir, tmp_path / "run", prefill=0, decode=0, both=1, extra_args=args, env=env
    )
    address = stack.spec.gateway_address

    def exact(prompt: list[int], max_tokens: int):
        answer = generate(address, salted(prompt, max_tokens))
        assert answer.token_ids == hf_greedy(tiny_llama_dir, prompt, max_tokens)
        return answer

    try:
        first = list(range(5, 69))  # 4 full blocks
        turn1 = exact(first, 8)
        floods = [list(range(start, start + 120)) for start in (300, 500)]
        for flood in floods:
            exact(flood, 4)
        wait_for(marker.exists, 60, "the 5th disk write stalled mid-file")
        stalled_hash, temp = marker.read_text().split()
        assert 0 < Path(temp).stat().st_size < 128 + block_bytes  # a partial file, now
        (worker,) = [p.name for p in stack.processes if p.name.startswith("both")]
        failures = pool_stats(stack).worker_failures
        stack.signal(worker, signal.SIGKILL)
        stack.wait_exit(worker)
        wait_for(lambda: pool_stats(stack).worker_failures > failures, 60, "worker failed")
        assert Path(temp).exists()  # the kill left it behind

        stack.restart(worker)
        wait_healthy_pools(stack)
        assert not Path(temp).exists()  # removed at start, never indexed
        assert not list(disk.rglob("*.tmp")) and not list(disk.rglob(f"{stalled_hash}-*"))
        files = list(disk.rglob("*.kv"))
        (pool,) = wait_until_idle(stack).pools
        assert pool.num_offload_disk_blocks == len(files) == 4  # the whole files, found

        # The next turn is served from the four whole files; the flood request whose
        # block was half-written computes it (and what follows), never reads it.
        root = root_hash(SALT.encode(), "offload")
        second = first + list(turn1.token_ids) + list(range(80, 90))
        assert exact(second, 8).usage.cached_tokens == 4 * BLOCK
        (flood,) = [f for f in floods if stalled_hash in _hashes(f, root)]
        index = _hashes(flood, root).index(stalled_hash)
        assert exact(flood, 4).usage.cached_tokens <= index * BLOCK
        (pool,) = wait_until_idle(stack).pools
        assert pool.offload_disk_failed_blocks == 0  # nothing bad was even tried
        assert pool.num_free_blocks == pool.num_blocks  # nothing leaked
    finally:
        stack.stop()


def _hashes(prompt: list[int], root: bytes) -> list[str]:
    return [h.hex() for h in extend_block_hashes([], prompt, BLOCK, root)]
