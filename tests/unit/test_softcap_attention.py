"""Gemma 2's soft-capped attention scores (c * tanh(s / c) before the softmax) in the CPU path
(`kernels/cpu_paged_attention.py`: the C++ decode kernel, and the SDPA path's `_capped`
stand-in for prompts and for decodes without the kernel) and in the plain-torch reference
(`kernels/torch_paged.py`), against transformers' own `eager_attention_forward` of Gemma 2
run one sequence at a time: decodes, prompts with and without a cached prefix, with and
without a sliding window.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from kernels import cpu_ops, cpu_paged_attention, torch_paged
from tests.hf_attention import hf_paged_reference
from tests.unit.test_cpu_paged_attention import _setup
from tests.unit.test_sliding_window_attention import CASES

SCALE, CAP = 0.5, 2.0  # scores ~N(0, 4): the cap bends most of them


def _hf(query, k_cache, v_cache, tables, starts, seq_lens, window):
    """HF Gemma 2's eager attention per sequence, over a contiguous copy of its context."""
    return hf_paged_reference(
        eager_attention_forward, query, k_cache, v_cache, tables, starts, seq_lens, window,
        SCALE, softcap=CAP,
    )  # fmt: skip


@pytest.mark.parametrize("path", ["kernel", "sdpa", "torch"])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("seq_lens, q_lens", CASES)
def test_softcap_matches_hf_eager(seq_lens, q_lens, window, path) -> None:
    if path == "kernel" and not cpu_ops.available():
        pytest.skip("C++ kernels unavailable")
    block_size, heads, kv_heads, head_dim = 4, 8, 2, 16
    query, key, value, k_cache, v_cache, tables, starts, slots = _setup(
        seq_lens, q_lens, heads, kv_heads, head_dim, block_size, torch.float32
    )
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_paged.reshape_and_cache(key, value, ref_k, ref_v, slots)
    expected = _hf(query, ref_k, ref_v, tables, starts, seq_lens, window)
    if path == "torch":
        out = torch_paged.paged_attention(
            query, ref_k, ref_v, tables, starts, seq_lens, SCALE, window, CAP
        )
    else:
        plan = cpu_paged_attention.plan(
            slots, tables, starts, seq_lens, block_size, use_kernel=path == "kernel"
        )
        cpu_paged_attention.write(key, value, k_cache, v_cache, plan)
        out = cpu_paged_attention.attend(
            query, key, value, k_cache, v_cache, plan, SCALE, window, CAP
        )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Without the cap the result is far from it (the cap matters at these scores).
    plain = torch_paged.paged_attention(
        query, ref_k, ref_v, tables, starts, seq_lens, SCALE, window
    )
    assert max(seq_lens) == 1 or (plain - expected).abs().max() > 1e-2


def test_capped_prompt_rows_are_sliced(monkeypatch) -> None:
    """Long prompts take `_capped` a slice of query rows at a time, with the same result."""
    block_size, heads, kv_heads, head_dim = 4, 4, 2, 16
    query, key, value, k_cache, v_cache, tables, starts, slots = _setup(
        [37], [23], heads, kv_heads, head_dim, block_size, torch.float32
    )
    plan = cpu_paged_attention.plan(slots, tables, starts, [37], block_size)
    cpu_paged_attention.write(key, value, k_cache, v_cache, plan)
    whole = cpu_paged_attention.attend(query, key, value, k_cache, v_cache, plan, SCALE, 9, CAP)
    monkeypatch.setattr(cpu_paged_attention, "_CAPPED_ROWS", 5)
    sliced = cpu_paged_attention.attend(query, key, value, k_cache, v_cache, plan, SCALE, 9, CAP)
    torch.testing.assert_close(sliced, whole, atol=1e-6, rtol=1e-6)
