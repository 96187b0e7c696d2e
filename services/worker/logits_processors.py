"""The sampler's logits processors as batched tensor functions (no per-row Python loops).

Sparse processors (bias, stop-token suppression, penalties) take flat `(rows, token_ids)`
index tensors, one entry per occurrence, and per-row parameter tensors `[B]`; they change
`logits` in place and touch only the listed entries. Where a history repeats a token, every
duplicate entry writes the same value, so the result does not depend on write order.
Truncation (top-k, top-p, min-p) works on each row's logits sorted in descending order.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def add_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor
) -> None:
    """logits[rows[i], token_ids[i]] += values[i] (each (row, token) listed at most once)."""
    logits.index_put_((rows, token_ids), values, accumulate=True)


def suppress_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """logits[rows[i], token_ids[i]] = -inf (min_tokens: stop tokens before the minimum)."""
    logits[rows, token_ids] = NEG_INF


def apply_repetition_penalty(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, penalty: torch.Tensor
) -> None:
    """HF/CTRL repetition penalty for every (row, token) seen in the prompt or output:
    positive logits divided by the row's penalty, negative ones multiplied. penalty: [B]."""
    seen = logits[rows, token_ids]
    p = penalty[rows]
    logits[rows, token_ids] = torch.where(seen < 0, seen * p, seen / p)


def apply_presence_frequency(
    logits: torch.Tensor,
    rows: torch.Tensor,
    token_ids: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> None:
    """OpenAI/vLLM penalties over the OUTPUT tokens listed (one entry per occurrence):
    logit -= frequency * count + presence, for each distinct (row, token). presence,
    frequency: [B]."""
    keys = rows * logits.shape[1] + token_ids
    ordered = keys.sort().values
    counts = torch.searchsorted(ordered, keys, right=True) - torch.searchsorted(ordered, keys)
    seen = logits[rows, token_ids]
    logits[rows, token_ids] = seen - frequency[rows] * counts - presence[rows]


def apply_top_k_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the first top_k[r] entries of each descending row (top_k: int64 [R], >= 1)."""
    ranks = torch.arange(sorted_logits.shape[1], device=sorted_logits.device)
    return sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), NEG_INF)


def apply_top_p_sorted(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest prefix of each descending row whose probability mass reaches
    top_p[r] (the top token always stays; rows with top_p >= 1 are untouched)."""
    weights = (sorted_logits - sorted_logits[:, :1]).exp()
    cumulative = weights.cumsum(dim=-1)
    # cumulative[:, -1] is the row's total: dropped entries add exact zeros.
    mass_before = cumulative - weights
    drop = mass_before >= top_p.unsqueeze(1) * cumulative[:, -1:]
    drop &= (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    return sorted_logits.masked_fill(drop, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop entries whose probability is below min_p[r] times the row's top probability
    (any layout; min_p in [0, 1], so the top entry always stays)."""
    relative = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    return logits.masked_fill(relative < min_p.unsqueeze(1), NEG_INF)


def truncate_sorted(
    sorted_logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """top-k, then top-p, then min-p over descending rows (-inf marks what is dropped);
    None skips a filter no row uses."""
    kept = apply_top_k_sorted(sorted_logits, top_k)
    if top_p is not None:
        kept = apply_top_p_sorted(kept, top_p)
    if min_p is not None:
        kept = apply_min_p(kept, min_p)
    return kept


def truncate(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """`truncate_sorted` on unsorted rows: the same logits with dropped entries at -inf.
    top_k: int64 [R] in 1..V (V = off)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kept = truncate_sorted(sorted_logits, top_k, top_p, min_p)
    return torch.empty_like(logits).scatter_(1, order, kept)
