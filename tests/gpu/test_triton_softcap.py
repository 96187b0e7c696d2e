"""The Triton decode and prefill kernels with Gemma 2's score soft-cap (c * tanh(s / c) before
the softmax), alone and with a sliding window, against the torch reference
(`kernels.torch_paged`), on the same NaN-poisoned strided caches and shuffled tables as
`test_triton_kernels.py` (under the Triton CPU interpreter without CUDA).
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

SCALE, CAP = 0.5, 2.0  # scores of unit queries and keys at head_dim 16: most are bent


def _reference(query, k_cache, v_cache, tables, starts, seq_lens, window, softcap):
    return torch_paged.paged_attention(
        query.float(), k_cache.float(), v_cache.float(), tables, starts, seq_lens, SCALE,
        window, softcap,
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_softcap_matches_reference(device, num_splits, window) -> None:
    seq_lens, block_size, q_heads, kv_heads, head_dim = [1, 5, 33, 64, 17], 8, 4, 2, 16
    gen = torch.Generator().manual_seed(3)
    _, k_cache, v_cache, tables = paged_context(
        seq_lens, block_size, kv_heads, head_dim, torch.float32, device, gen
    )
    query = strided((len(seq_lens), q_heads, head_dim), torch.float32, device, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(
        query, k_cache, v_cache, tables, lens, SCALE, num_splits=num_splits, window=window,
        softcap=CAP,
    )  # fmt: skip
    starts = list(range(len(seq_lens) + 1))
    expected = _reference(query, k_cache, v_cache, tables, starts, seq_lens, window, CAP)
    assert_matches(out, expected, torch.float32)
    uncapped = _reference(query, k_cache, v_cache, tables, starts, seq_lens, window, None)
    assert (uncapped.cpu() - expected.cpu()).abs().max() > 1e-2  # the cap matters here


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 5])
def test_prefill_softcap_matches_reference(device, window) -> None:
    block_size, q_heads, kv_heads, head_dim = 8, 4, 2, 16
    gen = torch.Generator().manual_seed(1)
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
        SCALE,
        max_query_len=max(new for _, new in MIXED_BATCH),
        window=window,
        softcap=CAP,
    )
    expected = _reference(query, k_cache, v_cache, tables, starts, seq_lens, window, CAP)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [0, -1.0, True, "2"])
def test_softcap_must_be_positive(device, softcap) -> None:
    gen = torch.Generator().manual_seed(0)
    _, k_cache, v_cache, tables = paged_context([4], 4, 1, 16, torch.float32, device, gen)
    query = strided((1, 2, 16), torch.float32, device, gen)
    lens = torch.tensor([4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="softcap"):
        paged_decode_attention(query, k_cache, v_cache, tables, lens, SCALE, softcap=softcap)
