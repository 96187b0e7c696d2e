"""Hugging Face's eager attention as the reference for Tandem's paged attention paths: a
family's `eager_attention_forward` run one sequence at a time over a contiguous copy of its
context read out of the paged cache (causal, optionally windowed: p - W < k <= p)."""

from __future__ import annotations

import types
from collections.abc import Callable

import torch


def sequence_context(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    starts: list[int],
    seq_lens: list[int],
    i: int,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence `i`'s queries [q, heads, dim], its keys and values read out of the paged
    cache in order [seq_len, kv_heads, dim] (float32), and which keys each query sees
    [q, seq_len] (causal, and p - W < k <= p with a window)."""
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    seq_len = seq_lens[i]
    blocks = tables[i, : -(-seq_len // block_size)].long()
    keys = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:seq_len].float()
    values = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:seq_len].float()
    q = query[starts[i] : starts[i + 1]].float()
    q_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return q, keys, values, visible


def hf_paged_reference(
    eager: Callable,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    starts: list[int],
    seq_lens: list[int],
    window: int | None,
    scale: float,
    module_fields: dict | None = None,
    **eager_kwargs,
) -> torch.Tensor:
    """`eager`: e.g. transformers' Gemma 2 or gpt-oss `eager_attention_forward`;
    `module_fields`: attributes it reads off its module besides the GQA group (gpt-oss's
    `sinks`); `eager_kwargs`: its other arguments (Gemma 2's `softcap`). Float32 out,
    shaped like `query` ([tokens, heads, head_dim], sequences back to back at `starts`)."""
    kv_heads, heads = k_cache.shape[2], query.shape[1]
    module = types.SimpleNamespace(
        num_key_value_groups=heads // kv_heads, training=False, **(module_fields or {})
    )
    out = torch.empty(query.shape, dtype=torch.float32)
    for i in range(len(seq_lens)):
        q, keys, values, visible = sequence_context(
            query, k_cache, v_cache, tables, starts, seq_lens, i, window
        )
        mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
        result, _ = eager(
            module,
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            mask[None, None],
            scaling=scale,
            **eager_kwargs,
        )
        out[starts[i] : starts[i + 1]] = result[0]
    return out
