"""The plain-torch paged kernels against dense attention over contiguous K/V."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.torch_paged import paged_attention, reshape_and_cache
from services.worker.kv_cache import KvCache


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Reference in float64: q [q_len, H, D] are the last q_len of the k/v [seq_len, KV, D]."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv, _ = k.shape
    group = num_heads // num_kv
    kv_head = torch.arange(num_heads) // group
    k_full = k.double()[:, kv_head].transpose(0, 1)  # [H, seq, D]
    v_full = v.double()[:, kv_head].transpose(0, 1)
    allowed = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k_full, v_full, attn_mask=allowed, scale=scale
    )
    return out.transpose(0, 1)


def paged_setup(
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
):
    """Random per-sequence K/V written into a NaN-filled cache through shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    k_cache = torch.full((num_blocks, block_size, num_kv, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_needed), dtype=torch.int32)
    keys, values, queries = [], [], []
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        table = [order.pop() for _ in range(blocks_needed[i])]
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv, head_dim, generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        reshape_and_cache(k, v, k_cache, v_cache, slots)
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return torch.cat(queries), k_cache, v_cache, tables, starts, keys, values, queries


def check_against_dense(seq_lens, q_lens, num_heads, num_kv, head_dim, block_size, dtype, atol):
    query, k_cache, v_cache, tables, starts, keys, values, queries = paged_setup(
        seq_lens, q_lens, num_heads, num_kv, head_dim, block_size, dtype
    )
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention(query, k_cache, v_cache, tables, starts, seq_lens, scale)
    assert out.shape == query.shape and out.dtype == dtype
    for i in range(len(seq_lens)):
        expected = dense_causal_attention(queries[i], keys[i], values[i], scale)
        torch.testing.assert_close(
            out[starts[i] : starts[i + 1]].double(), expected, atol=atol, rtol=atol
        )


@pytest.mark.parametrize(("num_heads", "num_kv"), [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_varlen_batch_matches_dense_attention(num_heads: int, num_kv: int, block_size: int) -> None:
    # decode, full prefill, prefill with a cached prefix, decode at a block boundary
    seq_lens = [37, 20, 45, 32]
    q_lens = [1, 20, 13, 1]
    check_against_dense(seq_lens, q_lens, num_heads, num_kv, 16, block_size, torch.float32, 1e-5)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_precision_inputs_within_tolerance(dtype: torch.dtype, atol: float) -> None:
    check_against_dense([33, 17, 9], [1, 17, 4], 8, 2, 32, 16, dtype, atol)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=4),
    block_size=st.sampled_from([1, 2, 3, 8]),
    group=st.sampled_from([1, 2, 4]),
)
def test_random_batches_match_dense_attention(shape, block_size: int, group: int) -> None:
    seq_lens = [s for s, _ in shape]
    q_lens = [max(1, min(q, s)) for s, q in shape]
    check_against_dense(seq_lens, q_lens, 2 * group, 2, 8, block_size, torch.float32, 1e-5)


def test_reshape_and_cache_skips_negative_slots_and_writes_through_views() -> None:
    cache = KvCache(
        num_blocks=4, block_size=4, num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32
    )
    k_cache, v_cache = cache.layer(1)
    key = torch.arange(5 * 2 * 3, dtype=torch.float32).view(5, 2, 3) + 1
    value = -key
    slots = torch.tensor([9, -1, 0, 15, -1])
    reshape_and_cache(key, value, k_cache, v_cache, slots)

    expected_k = torch.zeros(4, 4, 2, 3)
    expected_k[2, 1] = key[0]
    expected_k[0, 0] = key[2]
    expected_k[3, 3] = key[3]
    torch.testing.assert_close(cache.data[:, 1, 0], expected_k, atol=0, rtol=0)
    torch.testing.assert_close(cache.data[:, 1, 1], -expected_k, atol=0, rtol=0)
    assert cache.data[:, 0].abs().sum() == 0, "other layers untouched"


def test_reshape_and_cache_casts_to_cache_dtype() -> None:
    k_cache = torch.zeros(2, 2, 1, 4, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, 1, 4)
    reshape_and_cache(key, key, k_cache, v_cache, torch.tensor([3, 0, -1]))
    assert torch.equal(k_cache[1, 1, 0], key[0, 0].to(torch.bfloat16))
    assert torch.equal(v_cache[0, 0, 0], key[1, 0].to(torch.bfloat16))


def test_reshape_and_cache_validates() -> None:
    k_cache = torch.zeros(2, 2, 1, 4)
    key = torch.zeros(3, 1, 4)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(key, key, k_cache, k_cache.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="beyond cache"):
        reshape_and_cache(key, key, k_cache, k_cache.clone(), torch.tensor([0, 1, 4]))
    with pytest.raises(ValueError, match="heads/dim"):
        reshape_and_cache(
            torch.zeros(3, 2, 4),
            torch.zeros(3, 2, 4),
            k_cache,
            k_cache.clone(),
            torch.tensor([0, 1, 2]),
        )


def test_paged_attention_validates_metadata() -> None:
    cache = torch.zeros(4, 4, 2, 8)
    query = torch.zeros(5, 4, 8)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(query, cache, cache, tables, [0, 2, 4], [3, 3], 1.0)
    with pytest.raises(ValueError, match="2 queries for a context of 1"):
        paged_attention(query, cache, cache, tables, [0, 2, 5], [1, 3], 1.0)
    with pytest.raises(ValueError, match="need more than 2 blocks"):
        paged_attention(query, cache, cache, tables, [0, 2, 5], [2, 9], 1.0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention(torch.zeros(5, 3, 8), cache, cache, tables, [0, 2, 5], [2, 3], 1.0)
