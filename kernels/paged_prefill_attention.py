"""Triton FlashAttention over a paged KV cache for prefill/extend batches: a varlen batch of
S sequences whose new tokens (prompt chunks, fresh prompts, or single decode tokens mixed in)
attend causally to their cached prefix and to each other.

Sequence i owns query rows `query_start_loc[i] : query_start_loc[i + 1]`, the last q_len of
its `seq_lens[i]`-token context; query j sits at position `seq_len - q_len + j`. All keys and
values (prefix and new tokens, already written by `reshape_and_cache`) are read through the
block table: key position p is slot `p % block_size` of block `block_tables[i, p //
block_size]`, so the KV block size is independent of the key tile size.

Work split: one program per (query tile, sequence, kv head). A tile packs BLOCK_Q consecutive
query tokens times the GQA group of q heads sharing the kv head into BLOCK_M = BLOCK_Q *
GROUP_PAD rows (row r is token r // GROUP_PAD, head r % GROUP_PAD), so each K/V tile is loaded
once per group and feeds one BLOCK_M x BLOCK_N `tl.dot`. A program first sweeps the keys every
row of its tile may see (whole BLOCK_N tiles before the tile's first query position: no masks),
then the diagonal tiles with the causal mask; with a sliding window (`WINDOWED`, compiled
apart) every tile it sweeps, from the first its first query sees, takes the windowed mask.
Softmax is online in fp32 (exp2, scale folded by log2(e)). Tiles past a sequence's query
count exit at once, so the grid `(ceil(max_query_len / BLOCK_Q), S, kv_heads)` depends only
on shapes and `max_query_len`; no tensor value is read on the host. Values are therefore not
validated (the torch reference does): `max_query_len` must bound every sequence's q_len,
`q_len <= seq_len`, and each context must fit its block-table row.

A score soft-cap c (`softcap`, Gemma 2; `SOFTCAP` compiles apart) turns each score s into
c * tanh(s / c) before masking and the softmax (`triton_utils.soft_cap`, in log2 units).
Attention sinks (`sinks`, gpt-oss: one logit per query head; `SINKS` compiles apart) add
exp(sink) to each row's softmax denominator: the online softmax starts from the sink
(running maximum = sink, sum = 1, output 0).

An fp8 (float8_e4m3fn) cache is read as stored and each K/V tile upcast in registers to the
`tl.dot` operand dtype (the query's 16-bit dtype, exactly, or fp32); the kernel compiles
separately per cache dtype, so other dtypes run unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import (
    FP8,
    LOG2E,
    check_paged_args,
    check_softcap,
    dot_config,
    kv_block_slot,
    sink_logits,
    soft_cap,
)

# log2(e) inside kernels (a jit function reads only constexpr globals; the interpreter
# reads any, so only a compile for a GPU shows it).
SINK_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    sinks_ptr,
    qk_scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    # Heaviest tiles (last queries: longest key range) first, for better load balance.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = tile * BLOCK_Q
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tokens = first + rows // GROUP_PAD
    in_group = rows % GROUP_PAD
    heads = kv_head * GROUP + in_group
    row_mask = (tokens < q_len) & (in_group < GROUP)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q_rows = (q_start + tokens).to(tl.int64)
    q = tl.load(
        q_ptr
        + q_rows[:, None] * stride_qt
        + heads[:, None] * stride_qh
        + dims[None, :] * stride_qd,
        mask=io_mask,
        other=0.0,
    ).to(DOT_DTYPE)
    q_pos = prefix + tokens  # each row's position in the context

    if SINKS:  # the sink as the first score (log2 units): max = sink, sum = 1
        m_i = tl.load(sinks_ptr + heads, mask=in_group < GROUP, other=0.0) * SINK_LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kh + dims[None, :] * stride_kd
    v_head = v_cache_ptr + kv_head * stride_vh + dims[None, :] * stride_vd
    # Keys before `diagonal` are visible to every row of the tile (their positions are below
    # the tile's first query position, itself below seq_len); keys in [diagonal, kv_end) need
    # the causal mask. kv_end bounds what the tile's last valid query sees.
    diagonal = ((prefix + first) // BLOCK_N) * BLOCK_N
    kv_end = prefix + tl.minimum(first + BLOCK_Q, q_len)
    if WINDOWED:
        # A sliding window: no key is visible to every row. All tiles take the masked loop,
        # from the tile holding the first key the tile's first query sees.
        unmasked_end = 0
        masked_start = (tl.maximum(prefix + first - window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        unmasked_end = diagonal
        masked_start = diagonal

    for tile_start in range(0, unmasked_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        block, slot = kv_block_slot(table_row, pos, pos < unmasked_end, BLOCK_SIZE)
        k_offsets = (block * stride_kb + slot * stride_ks)[:, None]
        v_offsets = (block * stride_vb + slot * stride_vs)[:, None]
        if HEAD_DIM == HEAD_DIM_PAD:
            k = tl.load(k_head + k_offsets)
        else:
            k = tl.load(k_head + k_offsets, mask=dim_mask[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            scores = soft_cap(scores, softcap)
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if HEAD_DIM == HEAD_DIM_PAD:
            v = tl.load(v_head + v_offsets)
        else:
            v = tl.load(v_head + v_offsets, mask=dim_mask[None, :], other=0.0)
        acc = tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], input_precision=DOT_PRECISION
        )
        m_i = m_new

    for tile_start in range(masked_start, kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        key_mask = pos < kv_end
        block, slot = kv_block_slot(table_row, pos, key_mask, BLOCK_SIZE)
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(
            k_head + (block * stride_kb + slot * stride_ks)[:, None], mask=kv_mask, other=0.0
        )
        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            scores = soft_cap(scores, softcap)
        visible = (pos[None, :] <= q_pos[:, None]) & key_mask[None, :]
        if WINDOWED:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        # The first diagonal tile holds position `diagonal` <= every row's q_pos, so each row
        # has a finite maximum from its first tile on and exp2(-inf - m) stays 0, never NaN.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        if WINDOWED:  # a row may see nothing in its first tiles: shift by 0 there
            m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp2(m_i - m_shift)
            p = tl.exp2(scores - m_shift[:, None])
        else:
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + (block * stride_vb + slot * stride_vs)[:, None], mask=kv_mask, other=0.0
        )
        acc = tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], input_precision=DOT_PRECISION
        )
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def _tile_config(head_dim_pad: int, fp32: bool, fp8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for Hopper-class GPUs.

    16-bit operands: 128-row tiles (two warpgroups of wgmma) against 64 keys with three
    K/V stages in shared memory (~96 KiB at head_dim 128, ~180 registers per thread, no
    spills when compiled for sm_90). fp32 operands run exact ("ieee") products on the CUDA
    cores, whose register-held operand tiles force small tiles to avoid spilling; from an
    fp8 cache (tiles upcast in registers) they also spill when pipelined: one stage.
    An fp8 cache with 16-bit operands uses the 16-bit tiles.
    """
    if fp32:
        stages = 1 if fp8 else 2
        return (32, 32, 4, stages) if head_dim_pad <= 64 else (32, 16, 8, stages)
    if head_dim_pad <= 32:
        return 64, 32, 4, 3
    if head_dim_pad <= 128:
        return 128, 64, 8, 3
    return 64, 32, 8, 2


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a varlen batch of new tokens over their paged context; with a
    sliding `window` W, query position p sees keys p - W < k <= p only; with a `softcap` c,
    the scores are c * tanh(s / c); with `sinks` `[q_heads]`, each head's sink logit joins
    its softmax denominator.

    `query` `[T, q_heads, head_dim]`; caches `[num_blocks, block_size, kv_heads, head_dim]`
    (strided views allowed; the query's dtype or float8_e4m3fn); `block_tables` int
    `[S', max_blocks]` with S' >= S; `query_start_loc` int `[S + 1]`; `seq_lens` int `[S]`;
    `max_query_len` >= every sequence's query count. Returns `[T, q_heads, head_dim]` in
    the query's dtype.
    """
    check_paged_args(query, k_cache, v_cache, block_tables, seq_lens)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc must be [S + 1 = {num_seqs + 1}], got {tuple(query_start_loc.shape)}"
        )
    if query_start_loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"query_start_loc must be int32 or int64, got {query_start_loc.dtype}")
    if query_start_loc.device != query.device:
        raise ValueError(f"query_start_loc on {query_start_loc.device}, query on {query.device}")
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative int, got {max_query_len!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    check_softcap(softcap)
    sinks = sink_logits(sinks, query)
    if max_query_len > query.shape[0]:
        raise ValueError(f"max_query_len {max_query_len} > number of query rows {query.shape[0]}")
    num_tokens, num_q_heads, head_dim = query.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out

    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    dot_dtype, precision = dot_config(query.dtype, k_cache.dtype, _paged_prefill_kernel)
    block_m, block_n, num_warps, num_stages = _tile_config(
        head_dim_pad, dot_dtype == tl.float32, k_cache.dtype == FP8
    )
    block_m = max(block_m, group_pad)  # at least one query token per tile
    grid = (triton.cdiv(max_query_len, block_m // group_pad), num_seqs, num_kv_heads)
    _paged_prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        out if sinks is None else sinks,  # unused without SINKS
        scale * LOG2E,
        window or 0,
        (softcap or 1.0) * LOG2E,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_m // group_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
