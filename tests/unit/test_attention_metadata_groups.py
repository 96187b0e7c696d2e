"""The worker's side of KV groups: per-group attention metadata from a flat, interleaved
block table, and a pool whose blocks hold one group's layers in slots."""

import pytest
import torch

from common.kv_groups import kv_groups
from services.worker.kv_cache import KvCache
from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata

BS = 4


def test_each_group_gets_its_own_tables_and_slots() -> None:
    # sequence 0: 6 tokens (2 blocks per group); sequence 1: 1 new token after 4 (2 blocks)
    seqs = [
        SequenceSlice(0, 6, [10, 11, 12, 13]),  # group 0: 10, 12; group 1: 11, 13
        SequenceSlice(4, 1, [0, 21, 22, 23]),  # group 0: null, 22; group 1: 21, 23
    ]
    positions, meta = build_attention_metadata(seqs, BS, "cpu", num_groups=2)
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 4]
    assert len(meta.groups) == 2 and meta.for_group(0) is meta.groups[0]
    first, second = meta.groups
    assert first.block_tables.tolist() == [[10, 12], [0, 22]]
    assert second.block_tables.tolist() == [[11, 13], [21, 23]]
    assert first.slot_mapping.tolist() == [40, 41, 42, 43, 48, 49, 88]
    assert second.slot_mapping.tolist() == [44, 45, 46, 47, 52, 53, 92]
    assert first.seq_lens == second.seq_lens == [6, 5]
    one = build_attention_metadata(seqs[:1], BS, "cpu")[1]
    assert one.groups == () and one.for_group(3) is one


def test_a_table_short_of_any_group_is_refused() -> None:
    with pytest.raises(ValueError, match="in each of 2 KV groups, block table has 3"):
        build_attention_metadata([SequenceSlice(0, 6, [1, 2, 3])], BS, "cpu", num_groups=2)


def test_a_grouped_pool_maps_each_layer_to_its_slot() -> None:
    groups = kv_groups((8, None, 8, None), 4)  # layers (0, 2) and (1, 3)
    slots, layer_slots = groups.stage_slots(range(4))
    cache = KvCache(3, BS, slots, 1, 2, torch.float32, layer_slots=layer_slots, num_groups=2)
    assert cache.data.shape == (3, 2, 2, BS, 1, 2)
    assert cache.block_bytes == 2 * 2 * BS * 2 * 4  # two slots, K and V
    k1, _ = cache.layer(1)  # full group, slot 0
    k1.fill_(1.0)
    assert cache.group_of(1) == 1 and cache.group_of(2) == 0
    assert torch.equal(cache.layer(0)[0], k1) and cache.layer(3)[0].abs().sum() == 0
    with pytest.raises(ValueError, match="out of range"):
        KvCache(3, BS, 1, 1, 2, torch.float32, layer_slots=((0, 1),), num_groups=1)
