"""The parallel layout plans: query/KV heads per tensor-parallel rank (KV heads split, or
replicated when ranks outnumber them), layer ranges per pipeline stage, and the KV transfer
plan between two layouts for every pair of TP sizes 1/2/4/8 and KV-head counts 1/2/4/8 (and
pipeline stages): each destination rank gets exactly the heads and layers it holds, once
each, from a source rank that holds them, with replicated heads read from several ranks."""

from __future__ import annotations

import itertools

import pytest

from common.parallel_plan import (
    Layout,
    kv_heads_of_rank,
    kv_transfer_plan,
    layer_ranges,
    q_heads_of_rank,
)

SIZES = (1, 2, 4, 8)
HEADS = 8


@pytest.mark.parametrize("kv", SIZES)
@pytest.mark.parametrize("tp", SIZES)
def test_each_rank_holds_the_kv_heads_its_query_heads_read(tp, kv):
    group = HEADS // kv
    held = [kv_heads_of_rank(HEADS, kv, tp, r) for r in range(tp)]
    for r in range(tp):
        needed = {q // group for q in q_heads_of_rank(HEADS, kv, tp, r)}
        assert needed == set(held[r])
    if tp <= kv:  # split: every head on exactly one rank
        assert sorted(h for x in held for h in x) == list(range(kv))
    else:  # replicated: every head on tp / kv ranks
        assert all(sum(h in x for x in held) == tp // kv for h in range(kv))


def test_bad_sizes_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="must divide the model's 8 attention heads"):
        kv_heads_of_rank(8, 8, 3, 0)
    with pytest.raises(ValueError, match="must divide one another"):
        kv_heads_of_rank(12, 6, 4, 0)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be in"):
        layer_ranges(3, 4)


def test_layer_ranges_are_contiguous_and_balanced():
    assert layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert layer_ranges(8, 4) == [range(2 * i, 2 * i + 2) for i in range(4)]
    assert layer_ranges(4, 1) == [range(4)]


LAYOUTS = [Layout(tp, pp) for tp in SIZES for pp in (1, 2)]


@pytest.mark.parametrize("kv", SIZES)
@pytest.mark.parametrize(
    ("src", "dst"), list(itertools.product(LAYOUTS, LAYOUTS)), ids=lambda x: f"tp{x.tp}pp{x.pp}"
)
def test_every_destination_rank_gets_exactly_its_heads_from_ranks_that_hold_them(src, dst, kv):
    layers = 5
    plan = kv_transfer_plan(HEADS, kv, layers, src, dst)
    src_layers, dst_layers = layer_ranges(layers, src.pp), layer_ranges(layers, dst.pp)
    got: dict[tuple[int, int, int], int] = {}
    readers: dict[int, set[int]] = {}
    for piece in plan:
        s_stage, s_tp = divmod(piece.src_rank, src.tp)
        d_stage, d_tp = divmod(piece.dst_rank, dst.tp)
        s_held = kv_heads_of_rank(HEADS, kv, src.tp, s_tp)
        d_held = kv_heads_of_rank(HEADS, kv, dst.tp, d_tp)
        assert set(piece.layers) <= set(src_layers[s_stage])
        assert set(piece.layers) <= set(dst_layers[d_stage])
        assert set(piece.heads) <= set(s_held) and set(piece.heads) <= set(d_held)
        assert s_held[piece.src_head] == piece.heads.start
        assert d_held[piece.dst_head] == piece.heads.start
        for layer in piece.layers:
            for head in piece.heads:
                key = (piece.dst_rank, layer, head)
                got[key] = got.get(key, 0) + 1
                readers.setdefault(head, set()).add(piece.src_rank % src.tp)
    wanted = {
        (dst.rank(stage, r), layer, head)
        for stage, stage_layers in enumerate(dst_layers)
        for r in range(dst.tp)
        for layer in stage_layers
        for head in kv_heads_of_rank(HEADS, kv, dst.tp, r)
    }
    assert set(got) == wanted and set(got.values()) == {1}
    # A head replicated on n source ranks and held by m destination ranks is read from
    # min(n, m) of them.
    for head, sources in readers.items():
        holders = sum(head in kv_heads_of_rank(HEADS, kv, src.tp, r) for r in range(src.tp))
        takers = sum(head in kv_heads_of_rank(HEADS, kv, dst.tp, r) for r in range(dst.tp))
        assert len(sources) == min(holders, takers)


def test_same_layout_is_one_message_per_rank():
    plan = kv_transfer_plan(HEADS, 4, 6, Layout(2, 1), Layout(2, 1))
    assert [(p.src_rank, p.dst_rank, p.heads, p.layers) for p in plan] == [
        (0, 0, range(0, 2), range(6)),
        (1, 1, range(2, 4), range(6)),
    ]
