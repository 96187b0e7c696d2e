"""Moving KV between workers of different tensor-parallel layouts, on real pool tensors:
applying every slice of `kv_transfer_plan` with `copy_head_slice` gives each destination
rank exactly the KV heads it owns (bit for bit, in its own block ids), for prefill TP and
decode TP each of 1/2/4/8 and 1/2/4/8 KV heads; blocks outside the transfer stay as they
were."""

from __future__ import annotations

import itertools

import pytest
import torch

from common.parallel_plan import Layout, kv_heads_of_rank, kv_transfer_plan
from services.worker.kv_cache import block_runs
from services.worker.parallel.kv_ranks import copy_head_slice

NUM_HEADS, NUM_LAYERS, SLOTS, DIM = 8, 3, 2, 4


def pool(num_blocks: int, kv_heads: int) -> torch.Tensor:
    return torch.zeros(num_blocks, NUM_LAYERS, 2, SLOTS, kv_heads, DIM)


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_every_destination_rank_gets_exactly_its_heads(kv_heads):
    full = torch.randn(6, NUM_LAYERS, 2, SLOTS, kv_heads, DIM)  # the unsharded KV
    src_blocks, dst_blocks = [0, 1, 2, 5], [3, 4, 6, 0]
    runs = block_runs(src_blocks, dst_blocks)
    for tp_a, tp_b in itertools.product([1, 2, 4, 8], repeat=2):
        owned_a = [kv_heads_of_rank(NUM_HEADS, kv_heads, tp_a, r) for r in range(tp_a)]
        owned_b = [kv_heads_of_rank(NUM_HEADS, kv_heads, tp_b, r) for r in range(tp_b)]
        sources = [full[:, :, :, :, h.start : h.stop].clone() for h in owned_a]
        dests = [pool(7, len(h)).fill_(-1.0) for h in owned_b]
        plan = kv_transfer_plan(NUM_HEADS, kv_heads, NUM_LAYERS, Layout(tp_a), Layout(tp_b))
        for piece in plan:
            n = len(piece.heads)
            copy_head_slice(
                dests[piece.dst_rank],
                sources[piece.src_rank],
                runs,
                (piece.layers, piece.layers),
                (
                    range(piece.src_head, piece.src_head + n),
                    range(piece.dst_head, piece.dst_head + n),
                ),
            )
        for rank, heads in enumerate(owned_b):
            want = full[src_blocks][:, :, :, :, heads.start : heads.stop]
            assert torch.equal(dests[rank][dst_blocks], want), (tp_a, tp_b, rank)
            untouched = [b for b in range(7) if b not in dst_blocks]
            assert bool((dests[rank][untouched] == -1.0).all()), (tp_a, tp_b, rank)


def test_mismatched_slices_are_refused():
    with pytest.raises(ValueError, match="slice shapes differ"):
        copy_head_slice(
            pool(2, 2), pool(2, 2), [(0, 0, 1)], (range(0, 2), range(0, 1)), (range(2),) * 2
        )


@pytest.mark.parametrize("kv_heads", [2, 8])
def test_rank_pools_move_each_stages_layers_between_pipeline_and_tensor_layouts(kv_heads):
    """`RankPools.copy` over (tp, pp) layouts: every rank of the receiving worker holds its
    stage's layers (numbered from 0) and its heads, each copied from the source rank that
    holds them; a streamed copy of some layers writes only those."""
    from common.parallel_plan import layer_ranges
    from services.worker.parallel.kv_ranks import KvGeometry, RankPools

    geometry = KvGeometry(NUM_HEADS, kv_heads, NUM_LAYERS, SLOTS, DIM)
    full = torch.randn(6, NUM_LAYERS, 2, SLOTS, kv_heads, DIM)
    src_blocks, dst_blocks = [0, 1, 2, 5], [3, 4, 6, 0]
    runs = block_runs(src_blocks, dst_blocks)

    def rank_part(t, layout, rank):
        stage, tp_rank = divmod(rank, layout.tp)
        layers = layer_ranges(NUM_LAYERS, layout.pp)[stage]
        heads = kv_heads_of_rank(NUM_HEADS, kv_heads, layout.tp, tp_rank)
        return t[:, layers.start : layers.stop, :, :, heads.start : heads.stop]

    layouts = [Layout(1), Layout(2), Layout(1, 2), Layout(1, 3), Layout(2, 2)]
    for src, dst in itertools.product(layouts, repeat=2):
        sources = [rank_part(full, src, r).clone() for r in range(src.world_size)]
        dests = [
            torch.full((7, *geometry.block_shape(dst, r)), -1.0) for r in range(dst.world_size)
        ]
        pools = RankPools(geometry, dst, dests)
        pools.copy(src, sources, runs, 0, 1)  # the first layer, as a stream would
        pools.copy(src, sources, runs, 1, NUM_LAYERS)  # then the rest
        for rank, got in enumerate(dests):
            assert got.shape[1:] == rank_part(full, dst, rank).shape[1:], (src, dst, rank)
            want = rank_part(full[src_blocks], dst, rank)
            assert torch.equal(got[dst_blocks], want), (src, dst, rank)
            untouched = [b for b in range(7) if b not in dst_blocks]
            assert bool((got[untouched] == -1.0).all()), (src, dst, rank)


def test_a_first_layers_copy_leaves_later_stages_unwritten():
    from services.worker.parallel.kv_ranks import KvGeometry, RankPools

    geometry = KvGeometry(NUM_HEADS, 2, NUM_LAYERS, SLOTS, DIM)
    dst = Layout(1, 3)  # one layer per stage
    dests = [torch.full((3, *geometry.block_shape(dst, r)), -1.0) for r in range(3)]
    source = torch.randn(3, NUM_LAYERS, 2, SLOTS, 2, DIM)
    RankPools(geometry, dst, dests).copy(Layout(), [source], [(0, 0, 3)], 0, 2)
    assert torch.equal(dests[0][:, 0], source[:, 0]) and torch.equal(dests[1][:, 0], source[:, 1])
    assert bool((dests[2] == -1.0).all())
