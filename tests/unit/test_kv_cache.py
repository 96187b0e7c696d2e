"""KvCache layout, block transfer round trips and validation."""

from __future__ import annotations

import pytest
import torch

from services.worker.kv_cache import KvCache


def make_cache(dtype: torch.dtype = torch.float32, num_blocks: int = 6) -> KvCache:
    return KvCache(
        num_blocks=num_blocks, block_size=4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype
    )


def test_shape_zero_init_and_block_bytes() -> None:
    cache = make_cache(torch.bfloat16)
    assert cache.data.shape == (6, 3, 2, 4, 2, 8)
    assert cache.data.dtype == torch.bfloat16 and cache.data.device.type == "cpu"
    assert cache.data.abs().sum() == 0
    assert cache.block_bytes == 3 * 2 * 4 * 2 * 8 * 2
    assert cache.block_bytes == cache.data[0].numel() * cache.data.element_size()
    assert KvCache.bytes_per_block(4, 3, 2, 8, torch.float32) == 2 * cache.block_bytes


def test_num_blocks_for_bytes_rounds_down() -> None:
    per_block = KvCache.bytes_per_block(16, 2, 2, 16, torch.float16)
    assert (
        KvCache.num_blocks_for_bytes(10 * per_block + per_block - 1, 16, 2, 2, 16, torch.float16)
        == 10
    )
    assert KvCache.num_blocks_for_bytes(0, 16, 2, 2, 16, torch.float16) == 0
    with pytest.raises(ValueError, match="memory_bytes"):
        KvCache.num_blocks_for_bytes(-1, 16, 2, 2, 16, torch.float16)


def test_layer_views_alias_data() -> None:
    cache = make_cache()
    k, v = cache.layer(2)
    assert k.shape == v.shape == (6, 4, 2, 8)
    k[1, 2, 0, 3] = 7.0
    v[5, 0, 1, 0] = -3.0
    assert cache.data[1, 2, 0, 2, 0, 3] == 7.0
    assert cache.data[5, 2, 1, 0, 1, 0] == -3.0
    assert cache.data.abs().sum() == 10.0
    cache.data[0, 2, 0, 1, 1, 1] = 4.0
    assert k[0, 1, 1, 1] == 4.0
    assert k.untyped_storage().data_ptr() == cache.data.untyped_storage().data_ptr()


def test_each_block_is_one_contiguous_region() -> None:
    cache = make_cache()
    block = cache.data[3]
    assert block.is_contiguous()
    start = block.data_ptr() - cache.data.data_ptr()
    assert start == 3 * cache.block_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_scatter_round_trip_is_bit_identical(dtype: torch.dtype) -> None:
    source = make_cache(dtype)
    gen = torch.Generator().manual_seed(0)
    source.data.copy_(torch.randn(source.data.shape, generator=gen).to(dtype))
    source.data[2, 0, 0, 0, 0, 0] = float("nan")  # raw bytes travel, NaN included
    payload = source.gather_blocks([4, 2, 0])
    assert payload.dtype == torch.uint8 and payload.is_contiguous()
    assert payload.shape == (3, source.block_bytes)

    target = make_cache(dtype, num_blocks=8)
    target.scatter_blocks([1, 7, 5], payload)
    for src, dst in ((4, 1), (2, 7), (0, 5)):
        assert torch.equal(
            target.data[dst].view(torch.uint8).flatten(),
            source.data[src].view(torch.uint8).flatten(),
        )
    untouched = [b for b in range(8) if b not in (1, 7, 5)]
    assert target.data[untouched].abs().sum() == 0


def test_gather_is_a_copy_and_allows_repeats_and_empty() -> None:
    cache = make_cache()
    cache.data[1] = 1.0
    payload = cache.gather_blocks([1, 1])
    cache.data[1] = 2.0
    assert torch.equal(payload[0], payload[1])
    assert torch.equal(payload[0].view(torch.float32), torch.ones(cache.data[1].numel()))
    empty = cache.gather_blocks([])
    assert empty.shape == (0, cache.block_bytes)
    cache.scatter_blocks([], empty)


def test_scatter_validates_payload_and_ids() -> None:
    cache = make_cache()
    good = cache.gather_blocks([0, 1])
    with pytest.raises(ValueError, match="uint8"):
        cache.scatter_blocks([0, 1], good.view(torch.float32))
    with pytest.raises(ValueError, match="shape"):
        cache.scatter_blocks([0], good)
    with pytest.raises(ValueError, match="shape"):
        cache.scatter_blocks([0, 1], good[:, :-4])
    with pytest.raises(ValueError, match="distinct"):
        cache.scatter_blocks([3, 3], good)
    with pytest.raises(ValueError, match="out of range"):
        cache.scatter_blocks([0, 6], good)
    with pytest.raises(ValueError, match="out of range"):
        cache.gather_blocks([-1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"block_size": -4}, "block_size"),
        ({"head_dim": 2.5}, "head_dim"),
        ({"dtype": torch.int32}, "dtype"),
    ],
)
def test_constructor_validation(kwargs: dict, message: str) -> None:
    args = {
        "num_blocks": 2,
        "block_size": 4,
        "num_layers": 1,
        "num_kv_heads": 1,
        "head_dim": 8,
        "dtype": torch.float32,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        KvCache(**args)


def test_layer_index_validation() -> None:
    with pytest.raises(ValueError, match="layer index"):
        make_cache().layer(3)


def test_block_copies_between_two_caches_and_within_one() -> None:
    """Between caches (the offload tier, swap space) runs copy straight; within one
    (copy-on-write) every source is read before any destination is written."""
    pool, tier = make_cache(num_blocks=8), make_cache(num_blocks=6)
    pool.data.copy_(torch.randn(pool.data.shape))
    tier.data.copy_(torch.randn(tier.data.shape))
    before, stored = pool.data.clone(), tier.data.clone()
    pool.copy_blocks([(0, 2), (1, 3), (2, 4), (5, 0), (5, 7)], source=tier)  # a run of 3
    for s, d in [(0, 2), (1, 3), (2, 4), (5, 0), (5, 7)]:
        assert torch.equal(pool.data[d], stored[s])
    assert torch.equal(pool.data[[1, 5, 6]], before[[1, 5, 6]])
    assert torch.equal(tier.data, stored)
    shared = pool.data.clone()
    pool.copy_blocks([(2, 3), (3, 6)])  # block 3 is written and read
    assert torch.equal(pool.data[3], shared[2]) and torch.equal(pool.data[6], shared[3])
    with pytest.raises(ValueError, match="distinct"):
        pool.copy_blocks([(0, 1), (2, 1)], source=tier)
    with pytest.raises(ValueError, match="out of range"):
        pool.copy_blocks([(6, 1)], source=tier)
