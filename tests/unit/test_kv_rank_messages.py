"""KV between workers of different parallel layouts over UCX, without UCX: every source
rank gathers its messages (`rank_messages` of `kv_transfer_plan`) out of its own pool into
flat buffers, each buffer goes to its destination rank as it would on the wire (bytes only),
and the destination rank scatters it. Every destination rank of every (tp, pp) pair then
holds exactly its KV heads of its stage's layers, bit for bit, in its own block ids, and
nothing else changed. Plus the tags and the wire form of the slices."""

from __future__ import annotations

import itertools

import pytest
import torch

from common.kv_rank_messages import (
    DERIVED_TAG_BIT,
    rank_messages,
    rank_tag,
    slices_from_wire,
    slices_to_wire,
)
from common.parallel_plan import Layout, kv_heads_of_rank, kv_transfer_plan, layer_ranges
from services.worker.parallel.kv_message_io import gather_message, scatter_message

NUM_HEADS, NUM_LAYERS, SLOTS, DIM = 8, 3, 2, 4
LAYOUTS = [Layout(1, 1), Layout(2, 1), Layout(4, 1), Layout(1, 2), Layout(2, 2), Layout(1, 3)]


def rank_pools(full: torch.Tensor, layout: Layout, kv_heads: int, num_blocks: int, fill=None):
    """Each rank's pool: its heads of its stage's layers (of `full`, or `fill` everywhere)."""
    pools = []
    for layers in layer_ranges(NUM_LAYERS, layout.pp):
        for tp_rank in range(layout.tp):
            heads = kv_heads_of_rank(NUM_HEADS, kv_heads, layout.tp, tp_rank)
            if fill is None:
                part = full[:, layers.start : layers.stop, :, :, heads.start : heads.stop]
                pools.append(part.clone())
            else:
                shape = (num_blocks, len(layers), 2, SLOTS, len(heads), DIM)
                pools.append(torch.full(shape, fill))
    return pools


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_every_destination_rank_gets_exactly_its_slices(kv_heads):
    full = torch.randn(6, NUM_LAYERS, 2, SLOTS, kv_heads, DIM)
    src_blocks, dst_blocks = [0, 1, 2, 5], [3, 4, 6, 0]
    for src, dst in itertools.product(LAYOUTS, repeat=2):
        sources = rank_pools(full, src, kv_heads, 6)
        dests = rank_pools(full, dst, kv_heads, 7, fill=-1.0)
        src_first = [r.start for r in layer_ranges(NUM_LAYERS, src.pp)]
        dst_first = [r.start for r in layer_ranges(NUM_LAYERS, dst.pp)]
        plan = kv_transfer_plan(NUM_HEADS, kv_heads, NUM_LAYERS, src, dst)
        for message in rank_messages(plan):
            nbytes = message.nbytes(len(src_blocks), SLOTS, DIM, 4)
            flat = torch.empty(nbytes, dtype=torch.uint8)
            gather_message(
                sources[message.src_rank], src_blocks, message,
                src_first[message.src_rank // src.tp], flat,
            )  # fmt: skip
            wire = bytes(flat.numpy())  # only bytes cross
            received = torch.empty(nbytes, dtype=torch.uint8)
            received.copy_(torch.frombuffer(bytearray(wire), dtype=torch.uint8))
            scatter_message(
                dests[message.dst_rank], dst_blocks, message,
                dst_first[message.dst_rank // dst.tp], received,
            )  # fmt: skip
        want = rank_pools(full[src_blocks], dst, kv_heads, len(src_blocks))
        untouched = [b for b in range(7) if b not in dst_blocks]
        for rank, pool in enumerate(dests):
            assert torch.equal(pool[dst_blocks], want[rank]), (src, dst, rank)
            assert bool((pool[untouched] == -1.0).all()), (src, dst, rank)


def test_messages_group_the_plan_by_rank_pair_in_plan_order():
    plan = kv_transfer_plan(NUM_HEADS, 4, NUM_LAYERS, Layout(2, 1), Layout(1, 2))
    messages = rank_messages(plan)
    assert [(m.src_rank, m.dst_rank) for m in messages] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [p for m in messages for p in m.pieces] == sorted(
        plan, key=lambda p: [(m.src_rank, m.dst_rank) for m in messages].index(
            (p.src_rank, p.dst_rank))
    )  # fmt: skip
    # A one-process pair is one message of one slice: the whole block.
    (whole,) = rank_messages(kv_transfer_plan(NUM_HEADS, 4, NUM_LAYERS, Layout(), Layout()))
    assert whole.nbytes(1, SLOTS, DIM, 4) == NUM_LAYERS * 2 * SLOTS * 4 * DIM * 4


def test_rank_tags_keep_rank_zero_and_differ_per_source_rank():
    tag = (12345 << 32) | 7
    assert rank_tag(tag, 0) == tag
    tags = {rank_tag(tag, r) for r in range(1, 16)}
    assert len(tags) == 15 and all(t & DERIVED_TAG_BIT for t in tags)
    assert rank_tag(tag + 1, 1) != rank_tag(tag, 1)
    with pytest.raises(ValueError, match="top bit"):
        rank_tag(DERIVED_TAG_BIT | 1, 1)


def test_slices_cross_the_rank_pipe_unchanged_and_bad_ones_are_refused():
    plan = kv_transfer_plan(NUM_HEADS, 2, NUM_LAYERS, Layout(1, 3), Layout(4, 1))
    assert slices_from_wire(slices_to_wire(plan)) == tuple(plan)
    with pytest.raises(ValueError, match="bad KV slice"):
        slices_from_wire([[0, 1, 2]])
    with pytest.raises(ValueError, match="bad KV slice"):
        slices_from_wire([[0, 0, 0, 1, 0, 1, -1, 0]])
