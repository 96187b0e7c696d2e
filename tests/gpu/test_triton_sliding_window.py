"""The Triton decode and prefill kernels with a sliding window against the torch reference
(`kernels.torch_paged`, HF's rule: the query at p sees keys p - W < k <= p), on the same
NaN-poisoned strided caches and shuffled tables as `test_triton_kernels.py` (whose helpers
run the kernels under the Triton CPU interpreter without CUDA): windows shorter than a key
tile, than a block, spanning several tiles, and longer than every context; decode with one
and several splits; prefill chunks after a prefix, fresh prompts and single tokens.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel definitions

import pytest  # noqa: E402

from kernels import torch_paged  # noqa: E402
from kernels.paged_decode_attention import paged_decode_attention  # noqa: E402
from kernels.paged_prefill_attention import paged_prefill_attention  # noqa: E402
from tests.gpu.test_triton_kernels import (  # noqa: E402
    DEVICES,
    MIXED_BATCH,
    assert_matches,
    paged_context,
    strided,
)

WINDOWS = [1, 5, 20, 1000]


def _reference(query, k_cache, v_cache, tables, starts, seq_lens, scale, window):
    return torch_paged.paged_attention(
        query.float(), k_cache.float(), v_cache.float(), tables, starts, seq_lens, scale, window
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_window_matches_reference(device, num_splits, window) -> None:
    seq_lens, block_size, q_heads, kv_heads, head_dim = [1, 5, 33, 64, 17], 8, 4, 2, 16
    gen = torch.Generator().manual_seed(2)
    _, k_cache, v_cache, tables = paged_context(
        seq_lens, block_size, kv_heads, head_dim, torch.float32, device, gen
    )
    query = strided((len(seq_lens), q_heads, head_dim), torch.float32, device, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(
        query, k_cache, v_cache, tables, lens, 0.25, num_splits=num_splits, window=window
    )
    starts = list(range(len(seq_lens) + 1))
    expected = _reference(query, k_cache, v_cache, tables, starts, seq_lens, 0.25, window)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_window_matches_reference(device, window) -> None:
    block_size, q_heads, kv_heads, head_dim = 8, 4, 2, 16
    gen = torch.Generator().manual_seed(0)
    seq_lens = [prefix + new for prefix, new in MIXED_BATCH]
    starts = [0]
    for _, new in MIXED_BATCH:
        starts.append(starts[-1] + new)
    _, k_cache, v_cache, tables = paged_context(
        seq_lens, block_size, kv_heads, head_dim, torch.float32, device, gen
    )
    query = strided((starts[-1], q_heads, head_dim), torch.float32, device, gen)
    out = paged_prefill_attention(
        query,
        k_cache,
        v_cache,
        tables,
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        0.25,
        max_query_len=max(new for _, new in MIXED_BATCH),
        window=window,
    )
    expected = _reference(query, k_cache, v_cache, tables, starts, seq_lens, 0.25, window)
    assert_matches(out, expected, torch.float32)
