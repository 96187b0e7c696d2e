"""The host-memory KV offload tier end to end (`--kv-offload-cpu-bytes`): a conversation
whose prefix the worker's pool evicted comes back from the tier instead of being
recomputed, token for token as HF `generate`, with no block left held in either tier."""

from __future__ import annotations

import signal

import pytest

from common.model_config import ModelConfig
from common.pb.tandem.internal.v1.types_pb2 import WorkerRole
from common.prefix_hash import extend_block_hashes, root_hash
from services.worker.kv_offload.disk_format import identity_dir_name
from services.worker.kv_offload.keys import TierIdentity
from tests.fault_injection import wait_for, wait_healthy_pools
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.service.test_e2e import run_concurrently
from tests.service.test_e2e_scheduling import check_against_hf, workload
from tests.stack_client import (
    SMALL_POOLS,
    generate,
    greedy_request,
    log_lines_since,
    pool_stats,
    scrape,
    start_stack,
    total,
    wait_until_idle,
)

BLOCK = 16


def salted(prompt: list[int], max_tokens: int, salt: str = "offload"):
    request = greedy_request(prompt, max_tokens)
    request.cache_salt = salt
    return request


def tier(stack):
    """The stats of the pool with the offload tier (the one that runs prompts)."""
    (pool,) = [p for p in wait_until_idle(stack).pools if p.num_offload_cpu_blocks]
    return pool


def restart_with_block1_damaged(stack, role: str, disk, prompt: list[int], salt: str):
    """Stop the stack's `role` worker (SIGTERM: its disk writes done), damage the disk file
    of `prompt`'s block 1 meanwhile, and start it again over the same folder. The
    scheduler sees it gone before it comes back: a new process, an empty pool. Returns
    (the worker's name, block 1's hash, the damaged file)."""
    (worker,) = [p.name for p in stack.processes if p.name.startswith(role)]
    root = root_hash(salt.encode(), "offload")
    block1 = extend_block_hashes([], prompt, BLOCK, root)[1]
    (damaged,) = disk.rglob(f"{block1.hex()}-0.kv")
    failures = pool_stats(stack).worker_failures
    stack.signal(worker, signal.SIGTERM)
    stack.wait_exit(worker)
    wait_for(lambda: pool_stats(stack).worker_failures > failures, 60, "worker failed")
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    damaged.write_bytes(bytes(raw))
    stack.restart(worker)
    wait_healthy_pools(stack)
    return worker, block1, damaged


@pytest.mark.parametrize("topology", ["both", "prefill-decode", "both-tp2"])
def test_an_evicted_conversation_prefix_is_loaded_from_the_offload_tier(
    tiny_llama_dir, tmp_path, topology
):
    """A `both` worker; a prefill worker with the tier beside a decode worker (the prompt's
    blocks it loads are then sent on as usual; its tier given with vLLM's flags); a `both`
    worker of two tensor-parallel ranks (each loads and saves its own heads' slice)."""
    pool = ["--max-model-len", "160", "--num-blocks", "10", "--block-size", str(BLOCK)]
    offload = [*pool, "--kv-offload-cpu-bytes", "64MiB"]
    if topology == "prefill-decode":
        vllm_flags = [*pool, "--kv-offloading-size", "0.0625", "--kv-offloading-backend", "native"]
        shape, args = dict(prefill=1, decode=1), {"prefill": vllm_flags, "decode": pool}
    else:
        shape, args = dict(prefill=0, decode=0, both=1), {"both": offload}
        if topology == "both-tp2":
            args["both"] = [*offload, "--tensor-parallel-size", "2"]
    stack = start_stack(tiny_llama_dir, tmp_path / "run", extra_args=args, **shape)
    try:
        address = stack.spec.gateway_address
        first = list(range(5, 69))  # 4 full blocks
        turn1 = generate(address, salted(first, 8))
        assert turn1.token_ids == hf_greedy(tiny_llama_dir, first, 8)
        before = tier(stack)
        assert before.num_offload_cpu_blocks > 20 and before.offload_saved_blocks >= 4
        # Two unrelated prompts of 8 blocks each, one after the other: the pool of 10
        # blocks evicts every block of the first turn (the oldest freed go first).
        for start in (300, 500):
            flood = list(range(start, start + 120))
            assert generate(address, salted(flood, 4)).token_ids == hf_greedy(
                tiny_llama_dir, flood, 4
            )
        flooded = tier(stack)
        assert flooded.evictions - before.evictions >= 4
        # The next turn: the first turn's prompt and answer, then a follow-up.
        second = first + list(turn1.token_ids) + list(range(80, 90))
        turn2 = generate(address, salted(second, 8))
        assert turn2.token_ids == hf_greedy(tiny_llama_dir, second, 8)
        assert turn2.usage.cached_tokens == 4 * BLOCK  # blocks 0-3, all from the tier
        after = tier(stack)
        assert after.offload_hit_tokens - flooded.offload_hit_tokens == 4 * BLOCK
        assert after.offload_loaded_blocks - flooded.offload_loaded_blocks == 4
        assert after.prefix_hit_tokens == flooded.prefix_hit_tokens  # none on the device
        # Another cache_salt shares nothing, in the tier as on the device.
        other = generate(address, salted(second, 8, salt="tenant-b"))
        assert other.usage.cached_tokens == 0 and other.token_ids == turn2.token_ids
        pools = wait_until_idle(stack).pools
        assert all(p.num_free_blocks == p.num_blocks for p in pools)  # nothing leaked
        assert tier(stack).num_offload_cpu_cached_blocks > 0
        assert sum(p.num_offload_cpu_blocks > 0 for p in pool_stats(stack).pools) == 1
    finally:
        stack.stop()


def test_a_decode_worker_keeps_a_conversation_for_its_next_turn(tiny_llama_dir, tmp_path):
    """The tier on the decode worker (`handoff_tier`): the blocks a hand-off brought are
    saved there; once its pool evicted them, the next turn's hand-off loads them from the
    tier instead of moving them from the prefill worker, streamed or not."""
    pool = ["--max-model-len", "160", "--num-blocks", "10", "--block-size", str(BLOCK)]
    args = {"prefill": pool, "decode": [*pool, "--kv-offload-cpu-bytes", "64MiB"]}
    stack = start_stack(tiny_llama_dir, tmp_path / "run", extra_args=args, prefill=1, decode=1)
    try:
        address = stack.spec.gateway_address
        first = list(range(5, 69))  # 4 full blocks
        turn1 = generate(address, salted(first, 8))
        assert turn1.token_ids == hf_greedy(tiny_llama_dir, first, 8)
        before = tier(stack)
        assert before.role == WorkerRole.WORKER_ROLE_DECODE
        assert before.offload_saved_blocks == 4  # the prompt's blocks, as they arrived
        for start in (300, 500):  # evict every block of the first turn from both pools
            flood = list(range(start, start + 120))
            assert generate(address, salted(flood, 4)).token_ids == hf_greedy(
                tiny_llama_dir, flood, 4
            )
        flooded = tier(stack)
        assert flooded.evictions - before.evictions >= 4
        second = first + list(turn1.token_ids) + list(range(80, 90))  # 82 tokens: 6 blocks
        turn2 = generate(address, salted(second, 8))
        assert turn2.token_ids == hf_greedy(tiny_llama_dir, second, 8)
        after = tier(stack)
        assert after.offload_loaded_blocks - flooded.offload_loaded_blocks == 4
        assert after.kv_blocks_received - flooded.kv_blocks_received == 2  # only the rest
        assert after.offload_hit_tokens == flooded.offload_hit_tokens  # no prefix query's
        # Another cache_salt shares nothing: every block moves.
        other = generate(address, salted(second, 8, salt="tenant-b"))
        assert other.token_ids == turn2.token_ids
        assert tier(stack).kv_blocks_received - after.kv_blocks_received == 6
        pools = wait_until_idle(stack).pools
        assert all(p.num_free_blocks == p.num_blocks for p in pools)  # nothing leaked
    finally:
        stack.stop()


def test_a_decode_worker_reads_a_conversation_back_from_its_disk_tier(tiny_llama_dir, tmp_path):
    """A decode worker with a host tier of 4 blocks and a disk tier behind it: the first
    turn's blocks leave its pool and then its host tier (written to disk as the host tier
    lets them go), and the next turn's hand-off reads them from its disk instead of moving
    them from the prefill worker. The decode worker then restarts over the same folder,
    one file damaged meanwhile: the others are read again, the damaged one is a miss
    (moved from the prefill worker after all); the output stays HF-exact throughout."""
    disk = tmp_path / "kv"
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # tiny llama: layers, K/V, slots, heads, dim
    pool = ["--max-model-len", "160", "--num-blocks", "10", "--block-size", str(BLOCK)]
    tiers = [
        *("--kv-offload-cpu-bytes", str(4 * block_bytes)),
        *("--kv-offload-dir", str(disk), "--kv-offload-disk-bytes", "4MiB"),
    ]
    salt = "decode-disk-test"  # a known deployment salt: the test can name a block's file
    args = {
        "prefill": pool,
        "decode": [*pool, *tiers],
        "scheduler": ["--prefix-cache-salt", salt],
    }
    stack = start_stack(tiny_llama_dir, tmp_path / "run", extra_args=args, prefill=1, decode=1)
    try:
        address = stack.spec.gateway_address
        first = list(range(5, 69))  # 4 full blocks
        turn1 = generate(address, salted(first, 8))
        assert turn1.token_ids == hf_greedy(tiny_llama_dir, first, 8)
        for start in (300, 500):  # 7 full blocks each: its pool and host tier turn over
            generate(address, salted(list(range(start, start + 120)), 4))
        before = tier(stack)
        assert before.role == WorkerRole.WORKER_ROLE_DECODE
        assert before.num_offload_cpu_blocks == 4 and before.offload_disk_saved_blocks >= 4
        second = first + list(turn1.token_ids) + list(range(80, 90))  # 82 tokens: 6 blocks
        turn2 = generate(address, salted(second, 8))
        assert turn2.token_ids == hf_greedy(tiny_llama_dir, second, 8)
        after = tier(stack)
        assert after.offload_disk_loaded_blocks - before.offload_disk_loaded_blocks == 4
        assert after.offload_disk_failed_blocks == 0
        assert after.offload_loaded_blocks - before.offload_loaded_blocks == 4  # into its pool
        assert after.kv_blocks_received - before.kv_blocks_received == 2  # only the rest
        # Another cache_salt reads nothing from that disk: every block moves.
        other = generate(address, salted(second, 8, salt="tenant-b"))
        assert other.token_ids == turn2.token_ids
        apart = tier(stack)
        assert apart.offload_disk_loaded_blocks == after.offload_disk_loaded_blocks
        assert apart.kv_blocks_received - after.kv_blocks_received == 6

        # The decode worker stops and starts again; the file of block 1 is damaged meanwhile.
        worker, block1, damaged = restart_with_block1_damaged(stack, "decode", disk, first, salt)
        restarted = tier(stack)
        assert restarted.num_offload_disk_blocks >= 4  # its files, found again
        third = first + list(range(90, 100))  # 74 tokens: 5 blocks, 4 of them on disk
        turn3 = generate(address, salted(third, 8))
        assert turn3.token_ids == hf_greedy(tiny_llama_dir, third, 8)
        stats = tier(stack)
        assert stats.offload_disk_loaded_blocks - restarted.offload_disk_loaded_blocks == 3
        assert stats.offload_disk_failed_blocks - restarted.offload_disk_failed_blocks == 1
        assert stats.kv_blocks_received - restarted.kv_blocks_received == 2  # 1, and block 4
        assert not damaged.exists()  # never served, logged once
        bad = [x for x in log_lines_since(stack, 0, worker) if "kv_offload_bad_file" in x]
        assert len(bad) == 1 and block1.hex() in bad[0]
        pools = wait_until_idle(stack).pools
        assert all(p.num_free_blocks == p.num_blocks for p in pools)  # nothing leaked
    finally:
        stack.stop()


def test_the_disk_tier_serves_past_the_host_tier_and_a_worker_restart_but_never_a_bad_file(
    tiny_llama_dir, tmp_path
):
    """A host tier of 4 blocks and a disk tier behind it: the first turn's 4 blocks leave
    the device pool and then the host tier (to disk) under other traffic, and come back
    from disk. The worker then stops and starts again: its files are still found, except
    one whose bytes were damaged meanwhile, which is never served (its tokens are
    computed; the output stays HF-exact)."""
    disk = tmp_path / "kv"
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # tiny llama: layers, K/V, slots, heads, dim
    pool = ["--max-model-len", "160", "--num-blocks", "10", "--block-size", str(BLOCK)]
    tiers = [
        *("--kv-offload-cpu-bytes", str(4 * block_bytes)),
        *("--kv-offload-dir", str(disk), "--kv-offload-disk-bytes", "4MiB"),
    ]
    salt = "disk-tier-test"  # a known deployment salt: the test can name a block's file
    args = {"both": [*pool, *tiers], "scheduler": ["--prefix-cache-salt", salt]}
    stack = start_stack(
        tiny_llama_dir, tmp_path / "run", prefill=0, decode=0, both=1, extra_args=args,
        metrics=True,
    )  # fmt: skip
    try:
        address = stack.spec.gateway_address
        first = list(range(5, 69))  # 4 full blocks
        turn1 = generate(address, salted(first, 8))
        for start in (300, 500):  # 7 full blocks each: device and host tier both turn over
            flood = list(range(start, start + 120))
            generate(address, salted(flood, 4))
        before = tier(stack)
        assert before.num_offload_cpu_blocks == 4 and before.offload_disk_saved_blocks >= 4
        second = first + list(turn1.token_ids) + list(range(80, 90))
        turn2 = generate(address, salted(second, 8))
        assert turn2.token_ids == hf_greedy(tiny_llama_dir, second, 8)
        assert turn2.usage.cached_tokens == 4 * BLOCK  # read back from disk
        after = tier(stack)
        assert after.offload_disk_loaded_blocks - before.offload_disk_loaded_blocks == 4
        assert after.offload_disk_failed_blocks == 0
        (scheduler,) = [p for p in stack.processes if p.name == "scheduler"]
        samples = scrape(scheduler.metrics)
        for medium in ("CPU", "Disk"):  # bytes held, and time spent loading, per tier
            assert total(samples, "tandem:kv_offload_bytes", medium=medium) > 0
            assert total(samples, "tandem:kv_offload_load_seconds_total", medium=medium) > 0
        assert total(samples, "tandem:external_prefix_cache_hits_total") >= 4 * BLOCK

        # The worker stops (its writes done) and starts again over the same folder; the
        # file of the first turn's block 1 is damaged meanwhile.
        worker, block1, damaged = restart_with_block1_damaged(stack, "both", disk, first, salt)
        assert tier(stack).num_offload_disk_blocks >= 4  # what the restarted worker holds
        third = first + list(range(90, 100))
        turn3 = generate(address, salted(third, 8))
        assert turn3.token_ids == hf_greedy(tiny_llama_dir, third, 8)
        assert turn3.usage.cached_tokens == BLOCK  # block 0 from disk; block 1 was bad
        stats = tier(stack)
        assert stats.offload_disk_loaded_blocks >= 1 and stats.offload_disk_failed_blocks == 1
        assert not damaged.exists()  # the bad file is gone, never served, logged once
        bad = [x for x in log_lines_since(stack, 0, worker) if "kv_offload_bad_file" in x]
        assert len(bad) == 1 and block1.hex() in bad[0] and "checksum" in bad[0]
        pools = wait_until_idle(stack).pools
        assert all(p.num_free_blocks == p.num_blocks for p in pools)
    finally:
        stack.stop()


def test_each_tensor_parallel_rank_keeps_its_slice_on_disk_and_a_bad_one_is_a_miss_for_all(
    tiny_llama_dir, tmp_path
):
    """A `both` worker of two tensor-parallel ranks with the disk tier: each rank writes
    its heads' slice of a block to files of its own, a read counts only where it loaded
    on every rank; so a file damaged on rank 1 alone is a miss (computed, HF-exact)."""
    disk = tmp_path / "kv"
    rank_block_bytes = 2 * 2 * BLOCK * 1 * 16 * 4  # one of the two KV heads per rank
    pool = ["--max-model-len", "160", "--num-blocks", "10", "--block-size", str(BLOCK)]
    tiers = [
        *("--kv-offload-cpu-bytes", str(4 * rank_block_bytes)),
        *("--kv-offload-dir", str(disk), "--kv-offload-disk-bytes", "4MiB"),
    ]
    salt = "disk-tier-tp-test"
    args = {
        "both": [*pool, *tiers, "--tensor-parallel-size", "2"],
        "scheduler": ["--prefix-cache-salt", salt],
    }
    stack = start_stack(
        tiny_llama_dir, tmp_path / "run", prefill=0, decode=0, both=1, extra_args=args
    )
    try:
        address = stack.spec.gateway_address
        first = list(range(5, 69))  # 4 full blocks
        turn1 = generate(address, salted(first, 8))
        for start in (300, 500):  # the device pool and the host tier both turn over
            generate(address, salted(list(range(start, start + 120)), 4))
        before = tier(stack)
        assert before.num_offload_cpu_blocks == 4 and before.offload_disk_saved_blocks >= 4
        second = first + list(turn1.token_ids) + list(range(80, 90))
        turn2 = generate(address, salted(second, 8))
        assert turn2.token_ids == hf_greedy(tiny_llama_dir, second, 8)
        assert turn2.usage.cached_tokens == 4 * BLOCK  # both ranks' slices from disk
        after = tier(stack)
        assert after.offload_disk_loaded_blocks - before.offload_disk_loaded_blocks == 4
        # Damage rank 1's file of the first turn's block 2, then make the tiers let the
        # blocks go again so that the next turn reads them from disk.
        root = root_hash(salt.encode(), "offload")
        block2 = extend_block_hashes([], first, BLOCK, root)[2]
        rank1 = TierIdentity(
            model=ModelConfig.from_folder(tiny_llama_dir).name, num_slots=2,
            block_size=BLOCK, block_bytes=rank_block_bytes, dtype="torch.float32",
            tp_rank=1, tp_size=2,
        )  # fmt: skip
        files = sorted(disk.rglob(f"{block2.hex()}-0.kv"))
        assert len(files) == 2  # one per rank
        (damaged,) = [
            f for f in files if f.parent.parent.name == identity_dir_name(rank1.fingerprint)
        ]
        raw = bytearray(damaged.read_bytes())
        raw[len(raw) // 2] ^= 0x5A
        damaged.write_bytes(bytes(raw))
        for start in (700, 900):
            generate(address, salted(list(range(start, start + 120)), 4))
        flooded = tier(stack)
        third = first + list(range(90, 100))
        turn3 = generate(address, salted(third, 8))
        assert turn3.token_ids == hf_greedy(tiny_llama_dir, third, 8)
        assert turn3.usage.cached_tokens == 2 * BLOCK  # blocks 0-1; block 2 bad on rank 1
        stats = tier(stack)
        assert stats.offload_disk_failed_blocks - flooded.offload_disk_failed_blocks == 1
        assert not damaged.exists()
        pools = wait_until_idle(stack).pools
        assert all(p.num_free_blocks == p.num_blocks for p in pools)
    finally:
        stack.stop()


def test_tier_hits_stay_hf_exact_through_chunked_prefill_and_preemption(tiny_llama_dir, tmp_path):
    """`test_e2e_scheduling`'s workload (shared prefixes, queued together: it preempts on
    these small pools, prompts chunked by a 24-token budget), twice: the second round finds
    what the first computed in the offload tier, the device pool having turned over."""
    args = {
        "both": [*SMALL_POOLS["decode"], "--kv-offload-cpu-bytes", "64MiB"],
        "scheduler": SMALL_POOLS["scheduler"],
    }
    stack = start_stack(
        tiny_llama_dir, tmp_path / "run", prefill=0, decode=0, both=1, extra_args=args
    )
    try:
        work = workload(hf_tokenizer(str(tiny_llama_dir)))
        for _ in range(2):
            results = run_concurrently(stack.spec.gateway_address, work, held=stack)
            check_against_hf(tiny_llama_dir, work, results)
        pool = tier(stack)
        assert pool.preemptions > 0 and pool.offload_hit_tokens > 0
        assert pool.num_free_blocks == pool.num_blocks
        assert sum(r.usage.cached_tokens for r in results) > 0
    finally:
        stack.stop()
