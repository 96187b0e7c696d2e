"""On a CUDA machine: the KV offload's host tier beside a GPU pool is page-locked, and the
step's offload loads (host -> device, before the forward pass) and saves (device -> host,
after it) move whole blocks bit for bit. Skips without a GPU."""

from __future__ import annotations

import pytest
import torch

from common.kv_groups import kv_groups
from common.step_plan import BlockMoves
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KvCache
from services.worker.kv_offload_connector import OffloadConnector
from services.worker.startup import kv_offload_cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_offload_blocks_move_between_a_gpu_pool_and_pinned_host_memory():
    geometry = dict(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    pool = KvCache(num_blocks=8, device="cuda", **geometry)
    pool.data.copy_(torch.randn(pool.data.shape, device="cuda"))
    config = WorkerConfig(model="m", kv_offload_cpu_bytes=str(4 * pool.block_bytes))
    tier = kv_offload_cache(config, kv_groups(None, 2), geometry, pool.block_bytes, pinned=True)
    assert tier.num_blocks == 4 and tier.data.is_pinned()
    original = pool.data.clone()
    connector = OffloadConnector(pool, tier)  # its copies on a stream of their own
    connector.wait_for_save(BlockMoves(offload_out=[(1, 0), (5, 3)]), step_id=1)
    torch.cuda.synchronize()
    assert torch.equal(tier.data[0], original[1].cpu()) and torch.equal(
        tier.data[3], original[5].cpu()
    )
    connector.start_load_kv(BlockMoves(offload_in=[(3, 2), (0, 7)]), step_id=2)
    torch.cuda.current_stream().synchronize()  # the compute stream waited for the loads
    assert connector.get_finished()["offload_load_seconds"] > 0
    assert torch.equal(pool.data[2], original[5]) and torch.equal(pool.data[7], original[1])
    untouched = [b for b in range(8) if b not in (2, 7)]
    assert torch.equal(pool.data[untouched], original[untouched])


def test_a_step_that_overwrites_a_block_being_saved_waits_for_the_save():
    """Saves run on the connector's own stream; the next step's writes (on the compute
    stream, after `start_load_kv`) must not land before the save has read the block."""
    geometry = dict(num_layers=4, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.float32)
    pool = KvCache(num_blocks=64, device="cuda", **geometry)
    pool.data.copy_(torch.randn(pool.data.shape, device="cuda"))
    config = WorkerConfig(model="m", kv_offload_cpu_bytes=str(64 * pool.block_bytes))
    tier = kv_offload_cache(config, kv_groups(None, 4), geometry, pool.block_bytes, pinned=True)
    original = pool.data.clone()
    connector = OffloadConnector(pool, tier)
    pairs = [(b, b) for b in range(0, 64, 2)]  # every other block: runs of one
    connector.wait_for_save(BlockMoves(offload_out=pairs), step_id=1)
    connector.start_load_kv(BlockMoves(), step_id=2)
    pool.data.zero_()  # the next step's writes, queued on the compute stream
    torch.cuda.synchronize()
    for _, b in pairs:
        assert torch.equal(tier.data[b], original[b].cpu())
