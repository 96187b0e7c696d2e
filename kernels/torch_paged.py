"""Plain-torch reference for paged attention: writing new K/V into cache slots, and attending
over a varlen batch whose keys and values live in non-contiguous cache blocks.

Correct and simple rather than fast: every optimised kernel in this package is tested
against these two functions. Nothing here keeps state; the caller passes all metadata.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key[t]`/`value[t]` (`[T, kv_heads, head_dim]`) to cache slot `slot_mapping[t]`.

    A slot is `block * block_size + offset`; the caches are `[num_blocks, block_size, kv_heads,
    head_dim]` and may be strided views, which are written in place. Slot -1 skips the row.
    """
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(
            f"key/value must both be [T, kv_heads, head_dim], got {key.shape}/{value.shape}"
        )
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(
            f"k/v caches must both be 4-d and equal, got {k_cache.shape}/{v_cache.shape}"
        )
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(
            f"key heads/dim {tuple(key.shape[1:])} != cache {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}"
        )
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    slots = slots[keep]
    if slots.numel() == 0:
        return
    if int(slots.max()) >= num_blocks * block_size:
        raise ValueError(f"slot {int(slots.max())} beyond cache of {num_blocks * block_size} slots")
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    k_cache[blocks, offsets] = to_cache_dtype(key[keep], k_cache.dtype)
    v_cache[blocks, offsets] = to_cache_dtype(value[keep], v_cache.dtype)


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` cast to a cache dtype. For float8_e4m3fn, values beyond +-448 (and +-inf)
    saturate to +-448 and NaN stays NaN, on every torch version (torch 2.11's cast made a
    negative overflow NaN; 2.13's saturates), as the Triton write does and as vLLM clamps."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a varlen batch of new tokens over their paged context.

    Sequence `i` owns queries `query[query_start_loc[i]:query_start_loc[i + 1]]`, the last
    `q_len` tokens of a context of `seq_lens[i]` tokens whose K/V are already in blocks
    `block_tables[i, :ceil(seq_len / block_size)]`. Query `j` sits at position
    `seq_len - q_len + j` and sees keys at positions up to its own (with a sliding `window`
    W, only those above its own minus W: W positions, as Hugging Face's
    `sliding_window_overlay`). Query head `h` reads KV
    head `h // (q_heads // kv_heads)`. With a `softcap` c (Gemma 2), a score s becomes
    c * tanh(s / c) before masking, as Hugging Face's eager attention does. With `sinks`
    (gpt-oss's attention sinks: one logit per query head, `[q_heads]`), each head's softmax
    denominator also holds exp(sink): a column of that logit joins the scores for the softmax
    and is dropped after it, as Hugging Face's gpt-oss eager attention does. Scores and
    softmax run in float32; the result is `[T, q_heads, head_dim]` in the query's dtype.
    """
    starts = [int(x) for x in query_start_loc]
    lens = [int(x) for x in seq_lens]
    _check_attention_args(query, k_cache, v_cache, block_tables, starts, lens)
    if sinks is not None:
        if sinks.shape != (query.shape[1],):
            raise ValueError(f"sinks must be [q_heads={query.shape[1]}], got {tuple(sinks.shape)}")
        sinks = sinks.float().to(query.device)
    out = torch.empty_like(query)
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    # Decodes (one query each) share one batched gather and matmul; prompts (chunks of many
    # queries) are computed one by one, where the matmuls are large anyway.
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    if decodes:
        _decode_batch(
            query, k_cache, v_cache, block_tables, starts, lens, decodes, scale, out, window,
            softcap, sinks,
        )  # fmt: skip
    for i, q_len in enumerate(q_lens):
        if q_len > 1:
            _prefill_one(
                query, k_cache, v_cache, block_tables[i], starts[i], q_len, lens[i], scale, out,
                window, softcap, sinks,
            )  # fmt: skip
    return out


def _grouped(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[..., q_heads, d] -> float32 [..., kv_heads, group, d] (GQA without copying K/V)."""
    *lead, q_heads, head_dim = query.shape
    return query.float().reshape(*lead, num_kv_heads, q_heads // num_kv_heads, head_dim)


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's soft-cap of attention scores, in Hugging Face's steps (None: as they are)."""
    if softcap is None:
        return scores
    return torch.tanh(scores / softcap) * softcap


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension; with `sinks` (broadcastable to `scores[..., :1]`: one
    logit per head) a column of them joins the scores and is dropped after the softmax, so
    each row's weights sum to less than 1 (gpt-oss's attention sinks, Hugging Face's steps)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    combined = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1]


def _decode_batch(
    query, k_cache, v_cache, block_tables, starts, lens, seqs, scale, out, window, softcap, sinks
):
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    device = k_cache.device
    rows = torch.tensor([starts[i] for i in seqs], device=query.device)
    seq_lens = torch.tensor([lens[i] for i in seqs], device=device)
    max_blocks = -(-max(lens[i] for i in seqs) // block_size)
    tables = block_tables[torch.tensor(seqs, device=block_tables.device), :max_blocks]
    tables = tables.to(device=device, dtype=torch.long)
    # [n, max_blocks, block_size, kv_heads, d] -> [n, ctx, kv_heads, d]
    keys = k_cache[tables].reshape(len(seqs), -1, num_kv_heads, head_dim).float()
    values = v_cache[tables].reshape(len(seqs), -1, num_kv_heads, head_dim).float()
    padding = torch.arange(keys.shape[1], device=device)[None, :] >= seq_lens[:, None]
    values = values.masked_fill(padding[:, :, None, None], 0.0)  # padded slots may hold NaN
    q = _grouped(query[rows], num_kv_heads)  # [n, kv_heads, group, d]
    scores = capped(torch.einsum("nhgd,nkhd->nhgk", q, keys) * scale, softcap)
    hidden = padding
    if window is not None:  # the query sits at seq_len - 1
        k_pos = torch.arange(keys.shape[1], device=device)[None, :]
        hidden = padding | (k_pos <= seq_lens[:, None] - 1 - window)
    scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    heads = None if sinks is None else sinks.view(1, num_kv_heads, -1, 1)
    probs = sink_softmax(scores, heads)
    result = torch.einsum("nhgk,nkhd->nhgd", probs, values)
    out[rows] = result.reshape(len(seqs), -1, head_dim).to(query.dtype)


def _prefill_one(
    query, k_cache, v_cache, table, start, q_len, seq_len, scale, out, window, softcap, sinks
):
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_blocks = -(-seq_len // block_size)
    blocks = table[:num_blocks].to(device=k_cache.device, dtype=torch.long)
    keys = k_cache.index_select(0, blocks).reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
    values = v_cache.index_select(0, blocks).reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
    q = _grouped(query[start : start + q_len], num_kv_heads)  # [q, kv_heads, group, d]
    scores = capped(torch.einsum("qhgd,khd->hgqk", q, keys) * scale, softcap)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
    k_pos = torch.arange(seq_len, device=query.device)
    hidden = k_pos[None, :] > q_pos[:, None]
    if window is not None:
        hidden = hidden | (k_pos[None, :] <= q_pos[:, None] - window)
    scores = scores.masked_fill(hidden[None, None], float("-inf"))
    probs = sink_softmax(scores, None if sinks is None else sinks.view(num_kv_heads, -1, 1, 1))
    result = torch.einsum("hgqk,khd->qhgd", probs, values)
    out[start : start + q_len] = result.reshape(q_len, -1, head_dim).to(query.dtype)


def _check_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: list[int],
    lens: list[int],
) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [T, q_heads, head_dim], got {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k/v caches must both be 4-d and equal, got {k_cache.shape}/{v_cache.shape}"
        )
    if k_cache.shape[3] != query.shape[2]:
        raise ValueError(f"query head_dim {query.shape[2]} != cache head_dim {k_cache.shape[3]}")
    if query.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(
            f"query heads ({query.shape[1]}) must be a multiple of kv heads ({k_cache.shape[2]})"
        )
    if len(starts) != len(lens) + 1 or starts[0] != 0 or starts[-1] != query.shape[0]:
        raise ValueError(
            f"query_start_loc must have len(seq_lens)+1 entries from 0 to T={query.shape[0]}, "
            f"got {starts}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] < len(lens):
        raise ValueError(f"block_tables must be [S, max_blocks], got {tuple(block_tables.shape)}")
    block_size = k_cache.shape[1]
    for i, seq_len in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        if q_len < 0 or q_len > seq_len:
            raise ValueError(f"sequence {i}: {q_len} queries for a context of {seq_len} tokens")
        if -(-seq_len // block_size) > block_tables.shape[1]:
            raise ValueError(
                f"sequence {i}: {seq_len} tokens need more than {block_tables.shape[1]} blocks"
            )
