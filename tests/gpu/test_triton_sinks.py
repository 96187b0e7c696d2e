"""The Triton decode and prefill kernels with gpt-oss's attention sinks (one logit per query
head in each softmax's denominator), alone and with a sliding window, with one split and
several (the combine kernel counts the sink), against the torch reference
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

SCALE = 0.5
SINKS = [1.0, -2.0, 30.0, 0.5]  # per query head; 30 outweighs every score


def _reference(query, k_cache, v_cache, tables, starts, seq_lens, window, sinks):
    return torch_paged.paged_attention(
        query.float(), k_cache.float(), v_cache.float(), tables, starts, seq_lens, SCALE,
        window, sinks=sinks,
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_sinks_match_reference(device, num_splits, window) -> None:
    seq_lens, block_size, q_heads, kv_heads, head_dim = [1, 5, 33, 64, 17], 8, 4, 2, 16
    gen = torch.Generator().manual_seed(3)
    _, k_cache, v_cache, tables = paged_context(
        seq_lens, block_size, kv_heads, head_dim, torch.float32, device, gen
    )
    query = strided((len(seq_lens), q_heads, head_dim), torch.float32, device, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    sinks = torch.tensor(SINKS, device=device)
    out = paged_decode_attention(
        query, k_cache, v_cache, tables, lens, SCALE, num_splits=num_splits, window=window,
        sinks=sinks,
    )  # fmt: skip
    starts = list(range(len(seq_lens) + 1))
    expected = _reference(query, k_cache, v_cache, tables, starts, seq_lens, window, sinks)
    assert_matches(out, expected, torch.float32)
    plain = _reference(query, k_cache, v_cache, tables, starts, seq_lens, window, None)
    assert (plain.cpu() - expected.cpu()).abs().max() > 1e-2  # the sinks matter here


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 5])
def test_prefill_sinks_match_reference(device, window) -> None:
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
    sinks = torch.tensor(SINKS, device=device)
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
        sinks=sinks,
    )
    expected = _reference(query, k_cache, v_cache, tables, starts, seq_lens, window, sinks)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sinks", [[1.0, 2.0, 3.0], "x"], ids=["wrong-count", "not-a-tensor"])
def test_sinks_must_be_one_per_query_head(device, sinks) -> None:
    gen = torch.Generator().manual_seed(0)
    _, k_cache, v_cache, tables = paged_context([4], 4, 1, 16, torch.float32, device, gen)
    query = strided((1, 2, 16), torch.float32, device, gen)
    lens = torch.tensor([4], dtype=torch.int32, device=device)
    if isinstance(sinks, list):
        sinks = torch.tensor(sinks, device=device)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(query, k_cache, v_cache, tables, lens, SCALE, sinks=sinks)
