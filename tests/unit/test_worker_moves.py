"""A real Worker's block moves (swap out, swap in, offload loads and saves, copy-on-write
copies) and the step ordering that KV receives wait on."""

import asyncio

import pytest
import torch

from common.step_plan import BlockMoves, DiskBlock, DiskRetain
from services.worker.batch import PlanError
from services.worker.config import WorkerConfig
from services.worker.disk_offload import DiskOffload
from services.worker.kv_offload.keys import BlockKey
from services.worker.worker import Worker


def run(coro):
    return asyncio.run(coro)


async def loaded(model, **settings) -> Worker:
    config = WorkerConfig(
        model=str(model), num_blocks=16, max_model_len=128, swap_space="256KiB", port=0, **settings
    )
    worker = await Worker.load(config, "moves")
    worker.kv_cache.data.copy_(torch.randn(worker.kv_cache.data.shape))
    return worker


async def with_disk_tier(model, folder) -> tuple[Worker, object, torch.Tensor]:
    """A worker with a host tier of random blocks and a disk tier under `folder`: (the
    worker, its host tier, a copy of the tier's bytes)."""
    disk = dict(kv_offload_dir=str(folder), kv_offload_disk_bytes="1MiB")
    worker = await loaded(model, kv_offload_cpu_bytes="512KiB", **disk)
    tier = worker.offload_cache
    tier.data.copy_(torch.randn(tier.data.shape))
    return worker, tier, tier.data.clone()


def test_swap_out_swap_in_and_copies_move_whole_blocks(tiny_llama_dir):
    async def scenario():
        worker = await loaded(tiny_llama_dir)
        kv, swap = worker.kv_cache, worker.swap_cache
        assert swap is not None and swap.num_blocks >= 2
        original = kv.data.clone()
        await worker.step(1, [], [], [], BlockMoves(swap_out=[(3, 0), (5, 1)]))
        assert torch.equal(swap.data[0], original[3]) and torch.equal(swap.data[1], original[5])
        await worker.step(2, [], [], [], BlockMoves(swap_in=[(0, 9), (1, 10)], copies=[(2, 7)]))
        assert torch.equal(kv.data[9], original[3]) and torch.equal(kv.data[10], original[5])
        assert torch.equal(kv.data[7], original[2])
        untouched = [b for b in range(16) if b not in (7, 9, 10)]
        assert torch.equal(kv.data[untouched], original[untouched])
        assert worker.executed_step_id == 2
        await asyncio.wait_for(worker.wait_for_step(2), timeout=1)
        await worker.close()

    run(scenario())


def test_offload_loads_run_before_the_forward_pass_and_saves_after_it(tiny_llama_dir):
    async def scenario():
        worker = await loaded(tiny_llama_dir, kv_offload_cpu_bytes="512KiB")
        kv, tier = worker.kv_cache, worker.offload_cache
        assert tier is not None and tier.num_blocks >= 3 and worker.swap_cache is not None
        assert kv.on_layer_needed is None  # on CPU the tier loads whole blocks before the pass
        tier.data.copy_(torch.randn(tier.data.shape))
        original, stored = kv.data.clone(), tier.data.clone()
        # One step loads tier block 0 into device block 4 and saves device block 4 (as the
        # forward pass left it) into tier block 0: the load reads before the save writes.
        await worker.step(1, [], [], [], BlockMoves(offload_in=[(0, 4)], offload_out=[(4, 0)]))
        assert torch.equal(kv.data[4], stored[0]) and torch.equal(tier.data[0], stored[0])
        await worker.step(2, [], [], [], BlockMoves(offload_out=[(6, 1), (7, 2)]))
        assert torch.equal(tier.data[1], original[6]) and torch.equal(tier.data[2], original[7])
        with pytest.raises(PlanError, match="offload_in"):
            await worker.step(3, [], [], [], BlockMoves(offload_in=[(tier.num_blocks, 1)]))
        await worker.close()
        bare = await loaded(tiny_llama_dir)
        assert bare.offload_cache is None and bare.kv_cache.on_layer_needed is None
        with pytest.raises(PlanError, match="no offload tier"):
            await bare.step(1, [], [], [], BlockMoves(offload_out=[(1, 0)]))
        await bare.close()

    run(scenario())


def test_disk_saves_and_loads_move_offload_blocks_through_verified_files(tiny_llama_dir, tmp_path):
    async def scenario():
        worker, tier, stored = await with_disk_tier(tiny_llama_dir, tmp_path)
        root, keys = b"r" * 32, [bytes([i]) * 32 for i in range(3)]
        saves = [DiskBlock(keys[i], root, i) for i in range(3)]
        await worker.step(1, [], [], [], BlockMoves(disk_saves=saves))
        worker.disk_offload.close()  # every write done (a load waits for its own anyway)
        files = sorted(tmp_path.rglob("*.kv"))
        assert len(files) == 3
        raw = bytearray(files[0].read_bytes())  # one file's payload flipped: never served
        raw[-1] ^= 0xFF
        files[0].write_bytes(bytes(raw))
        bad = next(k for k in keys if k.hex() in files[0].name)
        loads = [DiskBlock(k, root, 5 + i) for i, k in enumerate(keys)]
        worker.disk_offload = DiskOffload(worker.disk_offload.tier)
        result = await worker.step(2, [], [], [], BlockMoves(disk_loads=loads))
        assert result.disk_failed == (bad,) and set(result.disk_loaded) == set(keys) - {bad}
        assert result.disk_removed == (bad,)  # its file is gone, and the index says so
        for i, key in enumerate(keys):
            if key != bad:
                assert torch.equal(tier.data[5 + i], stored[keys.index(key)])
        assert len(list(tmp_path.rglob("*.kv"))) == 2
        foreign = await worker.step(
            3,
            [],
            [],
            [],
            BlockMoves(
                disk_loads=[DiskBlock(keys[1] if bad != keys[1] else keys[2], b"o" * 32, 9)]
            ),
        )
        assert foreign.disk_loaded == () and len(foreign.disk_failed) == 1  # another root
        await worker.close()

    run(scenario())


def test_disk_retains_rename_the_files_and_write_nothing(tiny_llama_dir, tmp_path):
    """A step's `disk_retains` move deadlines of blocks on disk: the file is renamed to
    carry it (same inode, same bytes, served as before); a block the disk lacks gets no
    file; an earlier deadline changes nothing."""

    async def scenario():
        worker, tier, stored = await with_disk_tier(tiny_llama_dir, tmp_path)
        root, keys = b"r" * 32, [bytes([i]) * 32 for i in range(2)]
        await worker.step(1, [], [], [], BlockMoves(disk_saves=[DiskBlock(keys[0], root, 0)]))
        # A load waits for the block's last write: the file is there after it.
        await worker.step(2, [], [], [], BlockMoves(disk_loads=[DiskBlock(keys[0], root, 4)]))
        (before,) = tmp_path.rglob("*.kv")
        inode, raw = before.stat().st_ino, before.read_bytes()
        until = 1_900_000_000.5
        retains = [DiskRetain(keys[0], until), DiskRetain(keys[1], until)]
        await worker.step(3, [], [], [], BlockMoves(disk_retains=retains))
        await worker.step(4, [], [], [], BlockMoves(disk_retains=[DiskRetain(keys[0], until - 60)]))
        result = await worker.step(
            5, [], [], [], BlockMoves(disk_loads=[DiskBlock(keys[0], root, 5)])
        )
        assert result.disk_loaded == (keys[0],)
        assert torch.equal(tier.data[5], stored[0])
        (after,) = tmp_path.rglob("*.kv")  # no file for keys[1]
        assert after.name == f"{keys[0].hex()}-0-r1900000001.kv"  # whole seconds, up
        assert after.stat().st_ino == inode and after.read_bytes() == raw  # only renamed
        assert worker.disk_offload.tier.retained_until(BlockKey(keys[0])) == 1_900_000_001
        assert worker.disk_offload.num_saved == 1
        await worker.close()

    run(scenario())


def test_moves_outside_the_pools_are_rejected(tiny_llama_dir):
    async def scenario():
        worker = await loaded(tiny_llama_dir)
        with pytest.raises(PlanError, match="block_copies"):
            await worker.step(1, [], [], [], BlockMoves(copies=[(2, 16)]))
        with pytest.raises(PlanError, match="swap_in"):
            await worker.step(1, [], [], [], BlockMoves(swap_in=[(10_000, 1)]))
        await worker.close()

    run(scenario())


def test_a_receive_waits_for_the_steps_planned_before_it(tiny_llama_dir):
    async def scenario():
        worker = await loaded(tiny_llama_dir)
        waiter = asyncio.create_task(worker.wait_for_step(2))
        await worker.step(1, [], [], [])
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await worker.step(2, [], [], [])
        await asyncio.wait_for(waiter, timeout=1)
        await worker.close()

    run(scenario())


def test_loading_steps_and_moves_run_on_one_tensor_thread(tiny_llama_dir, monkeypatch):
    """All of a worker's torch work shares one thread (one OpenMP team: a second team made
    every CPU step ~2.5x slower); steps hold the host's compute lock."""
    import threading

    import services.worker.worker as worker_module

    threads: list[str] = []
    real_load = worker_module.load_worker

    def recording_load(config, worker_id, ranks):
        threads.append(threading.current_thread().name)
        return real_load(config, worker_id, ranks)

    monkeypatch.setattr(worker_module, "load_worker", recording_load)

    async def scenario():
        worker = await loaded(tiny_llama_dir)
        assert worker.compute_lock is not None  # CPU workers take turns by default
        real_execute = worker.runner.execute
        worker.runner.execute = lambda work, step_id: (
            threads.append(threading.current_thread().name) or real_execute(work, step_id)
        )
        await worker.step(1, [], [], [], BlockMoves(copies=[(2, 7)]))
        await worker.close()

    run(scenario())
    assert len(threads) == 2 and len(set(threads)) == 1 and threads[0].startswith("tensor")
