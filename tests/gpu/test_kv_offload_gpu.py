"""On a CUDA machine: the KV offload's host tier beside a GPU pool is page-locked, and the
step's offload loads (host -> device, before the forward pass) and saves (device -> host,
after it) move whole blocks bit for bit. Skips without a GPU."""

from __future__ import annotations

import pytest
import torch

from common.kv_groups import kv_groups
from common.step_plan import BlockMoves
from services.worker.block_moves import run_moves, run_saves
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KvCache
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
    run_saves(BlockMoves(offload_out=[(1, 0), (5, 3)]), pool, tier)
    torch.cuda.synchronize()
    assert torch.equal(tier.data[0], original[1].cpu()) and torch.equal(
        tier.data[3], original[5].cpu()
    )
    run_moves(BlockMoves(offload_in=[(3, 2), (0, 7)]), pool, None, tier)
    torch.cuda.synchronize()
    assert torch.equal(pool.data[2], original[5]) and torch.equal(pool.data[7], original[1])
    untouched = [b for b in range(8) if b not in (2, 7)]
    assert torch.equal(pool.data[untouched], original[untouched])
