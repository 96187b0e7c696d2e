"""Sliding-window attention in the CPU path (`kernels/cpu_paged_attention.py`, with the C++
decode kernel and with its SDPA fallback) and in the plain-torch reference
(`kernels/torch_paged.py`), both against a dense reference written from Hugging Face's rule
(`masking_utils.sliding_window_overlay`: the query at position p sees keys k with
p - W < k <= p): decodes, prompts without and with a cached prefix, windows shorter and
longer than the context, a window of 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import cpu_ops, cpu_paged_attention, torch_paged
from tests.hf_attention import sequence_context
from tests.unit.test_cpu_paged_attention import _setup

CASES = [
    ([1], [1]),  # a first token
    ([17, 40, 5, 33], [1, 1, 1, 1]),  # pure decode, ragged contexts
    ([24], [24]),  # a whole prompt, no prefix
    ([30, 9, 21], [7, 1, 21]),  # a chunk after a prefix, a decode, a whole prompt
    ([41, 6], [13, 2]),  # chunks after prefixes
]


def _dense(query, k_cache, v_cache, tables, starts, seq_lens, scale, window):
    """One sequence at a time from a contiguous copy of its context, HF's mask."""
    group = query.shape[1] // k_cache.shape[2]
    out = torch.empty(query.shape, dtype=torch.float32)
    for i in range(len(seq_lens)):
        q, keys, values, visible = sequence_context(
            query, k_cache, v_cache, tables, starts, seq_lens, i, window
        )
        keys = keys.repeat_interleave(group, 1)
        values = values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        probs = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


@pytest.mark.parametrize("use_kernel", [False, True], ids=["sdpa", "kernel"])
@pytest.mark.parametrize("window", [1, 4, 8, 100])
@pytest.mark.parametrize("seq_lens, q_lens", CASES)
def test_window_matches_dense(seq_lens, q_lens, window, use_kernel) -> None:
    if use_kernel and not cpu_ops.available():
        pytest.skip("C++ kernels unavailable")
    block_size, heads, kv_heads, head_dim = 4, 8, 2, 16
    query, key, value, k_cache, v_cache, tables, starts, slots = _setup(
        seq_lens, q_lens, heads, kv_heads, head_dim, block_size, torch.float32
    )
    scale = 1 / math.sqrt(head_dim)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_paged.reshape_and_cache(key, value, ref_k, ref_v, slots)
    expected = _dense(query, ref_k, ref_v, tables, starts, seq_lens, scale, window)
    reference = torch_paged.paged_attention(
        query, ref_k, ref_v, tables, starts, seq_lens, scale, window
    )
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=1e-5)
    plan = cpu_paged_attention.plan(slots, tables, starts, seq_lens, block_size, use_kernel)
    cpu_paged_attention.write(key, value, k_cache, v_cache, plan)
    out = cpu_paged_attention.attend(query, key, value, k_cache, v_cache, plan, scale, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # The plan's masks are cached per window; full attention is unchanged after a window.
    full = cpu_paged_attention.attend(query, key, value, k_cache, v_cache, plan, scale)
    unwindowed = torch_paged.paged_attention(query, ref_k, ref_v, tables, starts, seq_lens, scale)
    torch.testing.assert_close(full, unwindowed, atol=1e-5, rtol=1e-5)


def test_kernel_window_reads_only_the_window() -> None:
    """The C++ kernel reads nothing before the window: NaN there leaves the result finite."""
    if not cpu_ops.available():
        pytest.skip("C++ kernels unavailable")
    block_size, heads, kv_heads, head_dim, window = 4, 4, 1, 8, 5
    query, _, _, k_cache, v_cache, tables, _, _ = _setup(
        [19], [1], heads, kv_heads, head_dim, block_size, torch.float32
    )
    expected = _dense(query, k_cache, v_cache, tables, [0, 1], [19], 0.3, window)
    for pos in range(19 - window):
        block = int(tables[0, pos // block_size])
        k_cache[block, pos % block_size] = float("nan")
        v_cache[block, pos % block_size] = float("nan")
    out = torch.empty_like(query)
    torch.ops.tandem_cpu.paged_decode_attention(
        out, query, k_cache, v_cache, tables.long(), torch.tensor([19]), 0.3, window
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
