"""On a CUDA machine: the KV offload's host tier beside a GPU pool is page-locked, and the
step's offload loads (host -> device, before the forward pass, layer slot by layer slot)
and saves (device -> host, after it) move whole blocks bit for bit; a layer's attention
never reads a block before that layer's copy, and the pass is not held back by the later
layers' copies. Skips without a GPU."""

from __future__ import annotations

import pytest
import torch

from common.kv_groups import kv_groups
from common.step_plan import BlockMoves
from services.worker.block_moves import run_copies
from services.worker.config import WorkerConfig
from services.worker.cuda_pitched_copy import pitched_copy
from services.worker.kv_cache import KvCache
from services.worker.kv_connector import KvConnectors
from services.worker.kv_offload_connector import OffloadConnector
from services.worker.kv_side_stream import SideStream
from services.worker.startup import kv_offload_cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Cycles of `torch.cuda._sleep` that hold the side stream back (about a second at ~2 GHz):
# far longer than the host takes between the calls the tests below make meanwhile.
HOLD_CYCLES = 2**31


def pool_and_tier(num_blocks: int, tier_blocks: int, **geometry) -> tuple[KvCache, KvCache]:
    """A CUDA pool of random bits and its pinned host tier of other random bits."""
    pool = KvCache(num_blocks=num_blocks, device="cuda", **geometry)
    pool.data.copy_(torch.randn(pool.data.shape, device="cuda"))
    config = WorkerConfig(model="m", kv_offload_cpu_bytes=str(tier_blocks * pool.block_bytes))
    groups = kv_groups(None, geometry["num_layers"])
    tier = kv_offload_cache(config, groups, geometry, pool.block_bytes, pinned=True)
    assert tier.num_blocks == tier_blocks and tier.data.is_pinned()
    tier.data.copy_(torch.randn(tier.data.shape))
    return pool, tier


def test_offload_blocks_move_between_a_gpu_pool_and_pinned_host_memory():
    geometry = dict(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    pool = KvCache(num_blocks=8, device="cuda", **geometry)
    pool.data.copy_(torch.randn(pool.data.shape, device="cuda"))
    config = WorkerConfig(model="m", kv_offload_cpu_bytes=str(4 * pool.block_bytes))
    tier = kv_offload_cache(config, kv_groups(None, 2), geometry, pool.block_bytes, pinned=True)
    assert tier.num_blocks == 4 and tier.data.is_pinned()
    original = pool.data.clone()
    connector = OffloadConnector(pool, tier)  # its copies on a stream of their own
    assert connector.loads_layers  # the CUDA runtime's pitched copy was found
    connector.wait_for_save(BlockMoves(offload_out=[(1, 0), (5, 3)]), step_id=1)
    torch.cuda.synchronize()
    assert torch.equal(tier.data[0], original[1].cpu()) and torch.equal(
        tier.data[3], original[5].cpu()
    )
    connector.start_load_kv(BlockMoves(offload_in=[(3, 2), (0, 7)]), step_id=2)
    connector.wait_for_save(BlockMoves(), step_id=2)  # after the pass: waits for every layer
    torch.cuda.current_stream().synchronize()  # the compute stream waited for the loads
    assert connector.get_finished()["offload_load_seconds"] > 0
    assert torch.equal(pool.data[2], original[5]) and torch.equal(pool.data[7], original[1])
    untouched = [b for b in range(8) if b not in (2, 7)]
    assert torch.equal(pool.data[untouched], original[untouched])


def test_layer_wise_loads_move_every_slot_bit_for_bit():
    """Runs of 3, 1 and 2 consecutive blocks, bf16, each layer waited for through the
    worker's connector point; blocks not loaded keep their bits."""
    geometry = dict(num_layers=6, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    pool, tier = pool_and_tier(48, 16, **geometry)
    original = pool.data.clone()
    connectors = KvConnectors([OffloadConnector(pool, tier)])
    assert connectors.loads_layers
    pairs = [(0, 10), (1, 11), (2, 12), (5, 3), (9, 40), (10, 41)]
    connectors.start_load_kv(BlockMoves(offload_in=pairs), step_id=1)
    for layer in range(6):
        connectors.wait_for_layer_load(layer)
    connectors.wait_for_save(BlockMoves(), step_id=1)
    torch.cuda.synchronize()
    assert connectors.get_finished()["offload_load_seconds"] > 0
    for s, d in pairs:
        assert torch.equal(pool.data[d].cpu(), tier.data[s])
    loaded = {d for _, d in pairs}
    untouched = [b for b in range(48) if b not in loaded]
    assert torch.equal(pool.data[untouched], original[untouched])


def test_a_layers_attention_never_reads_before_its_copy():
    """The side stream is held back by a long kernel queued before the loads. Reads of each
    layer's slot, queued on the compute stream right after `wait_for_layer(i)` (as the
    layer's attention is), still see the loaded bits; the last layers are not waited for
    one by one (as in a step whose pass asks for none) and after `finish_loads` their
    reads see them too. Meanwhile, work the compute stream queued before the first
    layer's wait ran to its end while the loads were still held back: the pass does not
    wait for every layer's copies before it starts."""
    layers = 4
    geometry = dict(num_layers=layers, block_size=16, num_kv_heads=8, head_dim=128,
                    dtype=torch.float32)  # fmt: skip
    pool, tier = pool_and_tier(64, 32, **geometry)
    pairs = [(s, 2 * s + 1) for s in range(32)]  # runs of one block
    src = torch.tensor([s for s, _ in pairs])
    dst = torch.tensor([d for _, d in pairs], device="cuda")  # no host copy in the reads
    side = SideStream(pool.device, pitched_copy())
    torch.cuda.synchronize()
    with torch.cuda.stream(side.stream):
        torch.cuda._sleep(HOLD_CYCLES)
    side.layer_loads(pool, tier, pairs)
    before_first_wait = torch.cuda.Event()
    before_first_wait.record()  # on the compute stream
    reads = []
    for layer in range(layers):
        if layer < 2:
            side.wait_for_layer(layer)
        else:
            side.finish_loads()  # no-op after the first call
        reads.append(pool.data[:, layer].index_select(0, dst))
    before_first_wait.synchronize()
    assert not side.last.query(), "the compute stream waited for all the loads up front"
    torch.cuda.synchronize()
    for layer, read in enumerate(reads):
        assert torch.equal(read.cpu(), tier.data[src, layer]), f"layer {layer} read early"
    assert side.load_seconds() > 0


def test_a_copy_on_write_of_a_loaded_block_waits_for_all_its_layers():
    """A copy-on-write copy before the pass reads a block the same step loads: the connector
    loads whole blocks then, and the copy (on the compute stream) sees every layer."""
    geometry = dict(num_layers=4, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.float32)
    pool, tier = pool_and_tier(16, 4, **geometry)
    connector = OffloadConnector(pool, tier)
    moves = BlockMoves(offload_in=[(1, 5), (2, 6)], copies=[(5, 9)])
    torch.cuda.synchronize()
    with torch.cuda.stream(connector.side.stream):
        torch.cuda._sleep(HOLD_CYCLES)
    connector.start_load_kv(moves, step_id=1)
    run_copies(moves, pool)
    connector.wait_for_save(moves, step_id=1)
    torch.cuda.synchronize()
    assert torch.equal(pool.data[9].cpu(), tier.data[1])
    assert torch.equal(pool.data[6].cpu(), tier.data[2])


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
