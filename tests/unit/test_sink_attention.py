"""gpt-oss's attention sinks (one learned logit per query head whose exp joins the softmax's
denominator) in the CPU path (`kernels/cpu_paged_attention.py`: the C++ decode kernel, and
the eager stand-in `_capped` for prompts and for decodes without the kernel) and in the
plain-torch reference (`kernels/torch_paged.py`), against transformers' own gpt-oss
`eager_attention_forward` run one sequence at a time: decodes, prompts with and without a
cached prefix, with and without a sliding window. The sinks span a head whose sink dwarfs
every score (its output ~0: the maximum subtracted must cover the sink) and one far below
them (no effect).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from kernels import cpu_ops, cpu_paged_attention, torch_paged
from tests.hf_attention import hf_paged_reference
from tests.unit.test_cpu_paged_attention import _setup
from tests.unit.test_sliding_window_attention import CASES

SCALE = 0.5  # scores ~N(0, 4) at head_dim 16
SINKS = torch.tensor([0.0, 1.5, -1.0, 3.0, 40.0, -40.0, 2.0, -0.5])  # one per query head


def _hf(query, k_cache, v_cache, tables, starts, seq_lens, window):
    """HF gpt-oss's eager attention per sequence, over a contiguous copy of its context."""
    return hf_paged_reference(
        eager_attention_forward, query, k_cache, v_cache, tables, starts, seq_lens, window,
        SCALE, module_fields={"sinks": SINKS},
    )  # fmt: skip


@pytest.mark.parametrize("path", ["kernel", "eager", "torch"])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("seq_lens, q_lens", CASES)
def test_sinks_match_hf_eager(seq_lens, q_lens, window, path) -> None:
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
            query, ref_k, ref_v, tables, starts, seq_lens, SCALE, window, sinks=SINKS
        )
    else:
        plan = cpu_paged_attention.plan(
            slots, tables, starts, seq_lens, block_size, use_kernel=path == "kernel"
        )
        cpu_paged_attention.write(key, value, k_cache, v_cache, plan)
        out = cpu_paged_attention.attend(
            query, key, value, k_cache, v_cache, plan, SCALE, window, sinks=SINKS
        )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert out[:, 4].abs().max() < 1e-6  # the sink of 40 takes (almost) all the weight
    # Without the sinks the result is far from it (they matter at these scores).
    plain = torch_paged.paged_attention(
        query, ref_k, ref_v, tables, starts, seq_lens, SCALE, window
    )
    assert (plain - expected).abs().max() > 1e-2
    torch.testing.assert_close(plain[:, 5], expected[:, 5], atol=1e-6, rtol=1e-6)  # sink -40


def test_sink_decode_kernel_on_a_bfloat16_cache() -> None:
    """The C++ kernel's bf16 cache path (scalar scores) adds the sinks too."""
    if not cpu_ops.available():
        pytest.skip("C++ kernels unavailable")
    block_size, heads, kv_heads, head_dim = 4, 8, 2, 16
    seq_lens, q_lens = [17, 40, 5], [1, 1, 1]
    query, key, value, k_cache, v_cache, tables, starts, slots = _setup(
        seq_lens, q_lens, heads, kv_heads, head_dim, block_size, torch.bfloat16
    )
    torch_paged.reshape_and_cache(key, value, k_cache, v_cache, slots)
    plan = cpu_paged_attention.plan(slots, tables, starts, seq_lens, block_size)
    out = cpu_paged_attention.attend(
        query, key, value, k_cache, v_cache, plan, SCALE, None, sinks=SINKS
    )
    expected = torch_paged.paged_attention(
        query.float(), k_cache.float(), v_cache.float(), tables, starts, seq_lens, SCALE,
        sinks=SINKS,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
