"""The CPU attention path (`kernels/cpu_paged_attention.py` and the C++ decode kernel it
calls) against the plain-torch reference (`kernels/torch_paged.py`): mixed batches of
decodes and prompt chunks (with and without a cached prefix), skipped slots, grouped-query
heads, float32 and bfloat16 caches, with the C++ kernel and with its SDPA fallback; the
kernel's float32 fast paths (8 heads scored at once, the vectorized softmax) at their edges.

Every slot holds finite garbage before the step, as in a real pool (zero-initialised, then
only ever written with K/V). For the C++ kernel, which reads nothing past a sequence's
length, blocks that no sequence references hold NaN instead, so reading one would show.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import cpu_ops, cpu_paged_attention, torch_paged

KERNEL = [False, True]


@pytest.fixture(scope="module")
def kernel_built() -> bool:
    return cpu_ops.available()


def _setup(seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, nan_free=True):
    gen = torch.Generator().manual_seed(0)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 4
    shape = (num_blocks, block_size, kv_heads, head_dim)
    fill = 0.5 if nan_free else float("nan")
    k_cache = torch.full(shape, fill, dtype=dtype)
    v_cache = torch.full(shape, fill, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    for i, count in enumerate(blocks):
        table = [order.pop() for _ in range(count)]
        tables[i, :count] = torch.tensor(table, dtype=torch.int32)
        for b in table:  # finite stale values everywhere in a referenced block
            k_cache[b] = torch.randn(shape[1:], generator=gen).to(dtype)
            v_cache[b] = torch.randn(shape[1:], generator=gen).to(dtype)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    total = starts[-1]
    slots = []
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    query = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    return query, key, value, k_cache, v_cache, tables, starts, torch.tensor(slots)


def _run_both(seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, use_kernel):
    query, key, value, k_cache, v_cache, tables, starts, slots = _setup(
        seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, nan_free=not use_kernel
    )
    scale = 1 / math.sqrt(head_dim)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_paged.reshape_and_cache(key, value, ref_k, ref_v, slots)
    expected = torch_paged.paged_attention(query, ref_k, ref_v, tables, starts, seq_lens, scale)
    plan = cpu_paged_attention.plan(slots, tables, starts, seq_lens, block_size, use_kernel)
    cpu_paged_attention.write(key, value, k_cache, v_cache, plan)
    out = cpu_paged_attention.attend(query, key, value, k_cache, v_cache, plan, scale)
    torch.testing.assert_close(k_cache, ref_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, ref_v, equal_nan=True, atol=0, rtol=0)
    return out, expected


@pytest.mark.parametrize("use_kernel", KERNEL, ids=["sdpa", "kernel"])
@pytest.mark.parametrize(
    "seq_lens, q_lens",
    [
        ([1], [1]),  # a first token
        ([17, 40, 5, 33], [1, 1, 1, 1]),  # pure decode, ragged contexts
        ([12, 30], [12, 30]),  # prompts, no prefix
        ([40, 9, 23, 64], [8, 1, 23, 1]),  # chunk after a prefix, decodes, a prompt
    ],
    ids=["first-token", "decodes", "prompts", "mixed"],
)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_matches_reference_float32(seq_lens, q_lens, heads, kv_heads, use_kernel, kernel_built):
    if use_kernel and not kernel_built:
        pytest.fail("the C++ CPU kernels did not build (see cpu_kernels_unavailable)")
    out, expected = _run_both(seq_lens, q_lens, heads, kv_heads, 32, 8, torch.float32, use_kernel)
    assert out.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim",
    [(16, 4, 24), (12, 4, 32), (6, 6, 16), (8, 2, 20)],
    ids=["two-tiles-of-8", "tile-of-8-and-4", "mha-6", "head-dim-20-scalar"],
)
@pytest.mark.parametrize("seq_lens", [[70], [8, 9, 64, 200, 3]], ids=["one-seq", "ragged"])
@pytest.mark.parametrize("sharp", [False, True], ids=["soft", "sharp"])
def test_kernel_scoring_tiles_and_softmax_tails(heads, kv_heads, head_dim, seq_lens, sharp):
    """The float32 kernel scores up to 8 query heads of a position at once (head_dim a
    multiple of 8) and takes its softmax 8 scores at a time with a polynomial exp: head
    counts that fill one, two or a part of a tile, a head_dim that takes the scalar loop,
    lengths around multiples of 8, one sequence (split by KV head over the threads), and
    scores hundreds apart (`sharp`: most weights under the exp's clamp)."""
    if not cpu_ops.available():
        pytest.fail("the C++ CPU kernels did not build")
    query, key, value, k_cache, v_cache, tables, starts, slots = _setup(
        seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim, 8, torch.float32
    )
    scale = (40.0 if sharp else 1.0) / math.sqrt(head_dim)
    torch_paged.reshape_and_cache(key, value, k_cache, v_cache, slots)
    expected = torch_paged.paged_attention(query, k_cache, v_cache, tables, starts, seq_lens, scale)
    out = torch.empty_like(query)
    torch.ops.tandem_cpu.paged_decode_attention(
        out, query, k_cache, v_cache, tables.long(), torch.tensor(seq_lens), scale
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("use_kernel", KERNEL, ids=["sdpa", "kernel"])
def test_matches_reference_bfloat16(use_kernel, kernel_built):
    if use_kernel and not kernel_built:
        pytest.fail("the C++ CPU kernels did not build")
    out, expected = _run_both([50, 7, 31], [1, 1, 6], 8, 4, 64, 16, torch.bfloat16, use_kernel)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_skipped_slots_write_nothing(kernel_built):
    query, key, value, k_cache, v_cache, tables, starts, slots = _setup(
        [9, 9], [1, 1], 4, 2, 16, 4, torch.float32, nan_free=False
    )
    before = k_cache.clone()
    slots[1] = -1  # a padded row: written nowhere
    plan = cpu_paged_attention.plan(slots, tables, starts, [9, 9], 4)
    cpu_paged_attention.write(key, value, k_cache, v_cache, plan)
    changed = (k_cache != before) & ~before.isnan()
    row0 = int(slots[0])
    assert changed.view(-1, 2, 16).any(dim=(1, 2)).nonzero().flatten().tolist() == [row0]


def test_kernel_rejects_bad_arguments(kernel_built):
    if not kernel_built:
        pytest.fail("the C++ CPU kernels did not build")
    q = torch.randn(2, 4, 16)
    cache = torch.zeros(3, 4, 2, 16)
    tables = torch.zeros(2, 1, dtype=torch.int64)
    lens = torch.ones(2, dtype=torch.int64)
    op = torch.ops.tandem_cpu.paged_decode_attention
    with pytest.raises(RuntimeError, match="int64"):
        op(torch.empty_like(q), q, cache, cache, tables.int(), lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        op(torch.empty(2, 3, 16), torch.randn(2, 3, 16), cache, cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float8_e4m3fn"):
        op(torch.empty_like(q), q, cache.half(), cache.half(), tables, lens, 1.0)
