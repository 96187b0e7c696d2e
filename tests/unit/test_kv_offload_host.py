"""The host-memory offload tier: one slab of block slots, LRU under a byte budget, blocks
served bit-exactly and only to the root they were stored under."""

import pytest
import structlog
import torch

from services.worker.kv_offload.host_tier import HostTier
from services.worker.kv_offload.keys import Medium
from tests.kv_offload_blocks import BLOCK_BYTES, OTHER_ROOT, ROOT, SHAPE, block, key


def tier(blocks: int, **kwargs) -> HostTier:
    return HostTier(blocks * BLOCK_BYTES + BLOCK_BYTES // 2, BLOCK_BYTES, **kwargs)


def test_put_beyond_budget_evicts_least_recently_used_and_get_refreshes():
    host = tier(3)
    assert host.capacity_blocks == 3 and host.enabled
    for i in range(3):
        assert host.put(key(i), ROOT, block(i)) == []
    assert host.get(key(0), ROOT) is not None  # 0 is now the most recent
    evicted = host.put(key(3), ROOT, block(3))
    assert [(e.key, e.medium, e.root, e.nbytes, e.reason) for e in evicted] == [
        (key(1), Medium.CPU, ROOT, BLOCK_BYTES, "lru")
    ]
    assert host.keys() == [key(2), key(0), key(3)]
    assert host.bytes_used == 3 * BLOCK_BYTES and len(host) == 3
    assert not host.contains(key(1)) and host.get(key(1), ROOT) is None
    evicted = host.put(key(4), ROOT, block(4))
    assert [e.key for e in evicted] == [key(2)]
    for i in (0, 3, 4):  # every survivor still holds its own bytes
        assert torch.equal(host.get(key(i), ROOT), block(i))


def test_putting_a_held_block_refreshes_it_without_evicting_or_copying():
    host = tier(2)
    host.put(key(0), ROOT, block(0))
    host.put(key(1), ROOT, block(1))
    assert host.put(key(0), ROOT, block(9)) == []  # equal hash: same KV, not rewritten
    assert host.keys() == [key(1), key(0)]
    assert torch.equal(host.get(key(0), ROOT), block(0))
    assert [e.key for e in host.put(key(2), ROOT, block(2))] == [key(1)]


def test_evicted_blocks_carry_a_copy_of_their_bytes_when_kept_for_demotion():
    host = tier(1, keep_evicted=True)
    host.put(key(0), ROOT, block(0))
    (evicted,) = host.put(key(1), ROOT, block(1))  # reuses the victim's slot
    assert evicted.key == key(0) and evicted.root == ROOT
    assert torch.equal(evicted.payload, block(0))  # copied before the slot was overwritten
    assert torch.equal(host.get(key(1), ROOT), block(1))
    plain = tier(1)
    plain.put(key(0), ROOT, block(0))
    assert plain.put(key(1), ROOT, block(1))[0].payload is None


def test_blocks_live_in_one_preallocated_slab_of_slots():
    host = tier(4, pin_memory=True)  # pinned only where CUDA is; plain memory here
    assert host.pinned == torch.cuda.is_available()
    for i in range(4):
        host.put(key(i), ROOT, block(i))
    views = [host.get(key(i), ROOT) for i in range(4)]
    storages = {v.untyped_storage().data_ptr() for v in views}
    assert len(storages) == 1 and views[0].untyped_storage().nbytes() == 4 * BLOCK_BYTES
    assert len({v.data_ptr() for v in views}) == 4


@pytest.mark.parametrize(
    "make",
    [
        lambda: (
            torch.tensor([float("nan"), -0.0, float("inf"), 1e-45, 3.14159])
            .repeat(BLOCK_BYTES // 20 + 1)[: BLOCK_BYTES // 4]
            .reshape(SHAPE[0], -1)
        ),
        lambda: (
            torch.randn(BLOCK_BYTES // 2, generator=torch.Generator().manual_seed(1))
            .to(torch.bfloat16)
            .reshape(2, -1)
        ),
        lambda: torch.randn(BLOCK_BYTES, generator=torch.Generator().manual_seed(2)).to(
            torch.float8_e4m3fn
        ),
    ],
    ids=["float32", "bfloat16", "fp8"],
)
def test_blocks_round_trip_bit_exactly_whatever_their_dtype(make):
    source = make()
    original = source.clone()
    host = tier(2)
    host.put(key(0), ROOT, source)
    source.view(torch.uint8).zero_()  # the tier holds a copy, not the caller's tensor
    held = host.get(key(0), ROOT)
    assert held.dtype == torch.uint8 and held.shape == (BLOCK_BYTES,)
    assert torch.equal(held, original.reshape(-1).view(torch.uint8))
    back = torch.empty_like(original)
    assert host.get(key(0), ROOT, out=back) is back
    assert torch.equal(back.view(torch.uint8), original.view(torch.uint8))


def test_a_block_of_the_wrong_size_or_a_bad_destination_is_refused():
    host = tier(2)
    with pytest.raises(ValueError, match="a block is 1024 bytes"):
        host.put(key(0), ROOT, torch.zeros(BLOCK_BYTES + 1, dtype=torch.uint8))
    host.put(key(0), ROOT, block(0))
    with pytest.raises(ValueError, match="contiguous"):
        host.get(key(0), ROOT, out=torch.empty(BLOCK_BYTES, 2, dtype=torch.uint8)[:, 0])
    with pytest.raises(ValueError, match="32 bytes"):
        host.get(key(0), b"short")


@pytest.mark.parametrize("budget", [0, BLOCK_BYTES - 1])
def test_a_budget_below_one_block_is_a_disabled_tier(budget):
    host = HostTier(budget, BLOCK_BYTES)
    assert not host.enabled and host.capacity_blocks == 0
    assert host.put(key(0), ROOT, block(0)) == []
    assert host.get(key(0), ROOT) is None and host.keys() == [] and host.bytes_used == 0


def test_remove_frees_the_slot():
    host = tier(1)
    host.put(key(0), ROOT, block(0))
    assert host.remove(key(0)) and not host.remove(key(0))
    assert host.put(key(1), ROOT, block(1)) == []  # the slot was free: nothing evicted
    assert host.keys() == [key(1)]


def test_a_block_is_never_served_under_another_salted_root():
    """cache_salt isolation: the entry is dropped, reported once and logged once."""
    host = tier(2)
    host.put(key(0), ROOT, block(0))
    host.put(key(1), ROOT, block(1))
    with structlog.testing.capture_logs() as logs:
        assert host.get(key(0), OTHER_ROOT) is None
        assert host.get(key(0), OTHER_ROOT) is None
        assert host.get(key(0), ROOT) is None  # dropped: never served again
    dropped = [e for e in logs if e["event"] == "kv_offload_block_dropped"]
    assert len(dropped) == 1 and dropped[0]["reason"] == "foreign"
    assert dropped[0]["block_hash"] == key(0).block_hash.hex()
    assert [(e.key, e.reason, e.root) for e in host.take_dropped()] == [(key(0), "foreign", ROOT)]
    assert host.take_dropped() == []
    assert host.keys() == [key(1)] and host.bytes_used == BLOCK_BYTES
