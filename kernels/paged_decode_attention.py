"""Triton split-KV ("flash-decoding") attention for decode steps: one new query token per
sequence attending over its whole paged context.

Work split: one program per (sequence, kv head, split). A program loads the query rows of the
whole GQA group that shares its kv head (q heads `kv_head * group ... + group - 1`, padded to
16 rows for `tl.dot`), so every K/V tile is read once per group, and walks its share of the
context in tiles of BLOCK_N tokens, gathering each token's cache row through the block table
(block `block_tables[s, pos // block_size]`, slot `pos % block_size`). Softmax is online, in
fp32 (base-2 exponentials with the scale folded into log2(e)). An fp8 (float8_e4m3fn) cache
is read as stored and each K/V tile upcast in registers to the `tl.dot` operand dtype (the
query's 16-bit dtype, exactly, or fp32), the kernel compiling separately per cache dtype.

With one split the program normalises and writes the output directly. With `num_splits > 1`
the context of each sequence is cut into `num_splits` contiguous ranges of whole tiles
(`ceil(tiles / num_splits)` each, so short sequences leave the last splits empty); every split
writes its normalised partial output and log-sum-exp to fp32 scratch, and a second kernel
combines the splits of each (sequence, q head), skipping empty ones (log-sum-exp -inf).

CUDA-graph contract: when `num_splits` and `max_seq_len` are given as Python ints, the function
reads no tensor values on the host (no `.item()`, `.tolist()`, or value-dependent branching):
the grid and the scratch shapes depend only on tensor shapes and those ints, and each
sequence's true length is read from `seq_lens` inside the kernel. Tiles and splits beyond a
sequence's length load nothing and are masked. With a sliding window W (`window`) the
splits cut the last W positions instead of the whole context (`WINDOWED` compiles apart).
A score soft-cap c (`softcap`, Gemma 2; `SOFTCAP` compiles apart) turns each score s into
c * tanh(s / c) before the softmax (`triton_utils.soft_cap`, in log2 units: both scaled by
log2(e)). Attention sinks (`sinks`, gpt-oss: one logit per query head; `SINKS` compiles
apart) add exp(sink) to each head's softmax denominator: with one split the online softmax
starts from the sink (running maximum = sink, sum = 1, output 0); with several the combine
kernel counts the sink as one more, empty, partial. `max_seq_len` only steers the split
heuristic (it may be any upper bound, e.g. the model's context length); without it the
bound `block_tables.shape[1] * block_size` is used, so even the defaults never synchronise.
For the same reason tensor values are not validated (the torch reference does): each
`seq_lens[s]` must fit its block-table row (a length of 0 yields zeros).
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
    num_sms,
    sink_logits,
    soft_cap,
)

MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost (query load, partial write) shows
MAX_SPLITS = 32


# log2(e) inside kernels (a jit function reads only constexpr globals; the interpreter
# reads any, so only a compile for a GPU shows it).
SINK_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    sinks_ptr,
    qk_scale,
    num_splits,
    window,
    softcap,
    stride_qs,
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
    stride_os,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + seq)
    if WINDOWED:  # the last `window` positions only: [seq_len - window, seq_len)
        lowest = tl.maximum(seq_len - window, 0)
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len - lowest, BLOCK_N), num_splits)
        start = lowest + split * tiles_per_split * BLOCK_N
    else:
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
        start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_offsets = (
        seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    )
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    q = q.to(DOT_DTYPE)

    if SINKS and not SPLIT:  # the sink as the first score (log2 units): max = sink, sum = 1
        m_i = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0) * SINK_LOG2E
        l_i = tl.full([GROUP_PAD], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kh + dims[None, :] * stride_kd
    v_head = v_cache_ptr + kv_head * stride_vh + dims[None, :] * stride_vd
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        key_mask = pos < end
        block, slot = kv_block_slot(table_row, pos, key_mask, BLOCK_SIZE)
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(
            k_head + (block * stride_kb + slot * stride_ks)[:, None], mask=kv_mask, other=0.0
        )
        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            scores = soft_cap(scores, softcap)
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        # Every tile holds at least one valid key (tile_start < end), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
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

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # empty split: l = 0, out = 0
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        # Partials are [S, q_heads, num_splits(, HEAD_DIM)] fp32; lse in log2 units.
        part = (seq * num_q_heads + heads).to(tl.int64) * num_splits + split
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_mask)  # empty split: -inf
        tl.store(
            part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
            out,
            mask=out_mask & (start < end),
        )
    else:
        out_offsets = seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _combine_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    sinks_ptr,
    num_splits,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    """One program merges the split partials of one (sequence, q head) (and the head's sink:
    a partial of log-sum-exp `sink` and output 0)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    base = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits
    lse = tl.load(part_lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"))
    live = lse > float("-inf")  # empty splits wrote no partial output
    top = tl.max(lse, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head) * SINK_LOG2E
        top = tl.maximum(top, sink)
    top = tl.where(top > float("-inf"), top, 0.0)  # no live split (length 0): output 0
    weights = tl.where(live, tl.exp2(lse - top), 0.0)
    part = tl.load(
        part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=live[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(weights, 0)
    if SINKS:
        total += tl.exp2(sink - top)
    out = tl.sum(part * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Splits per sequence: enough (sequence, kv head, split) programs to fill the GPU about
    twice over, but no split shorter than MIN_SPLIT_TOKENS of the longest context, and at
    most MAX_SPLITS. Large batches already fill the GPU and get 1 (no combine pass)."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(2 * num_sms(device), programs)
    by_length = triton.cdiv(max(1, max_seq_len), MIN_SPLIT_TOKENS)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def _tile_config(head_dim_pad: int, fp32: bool, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N keys per tile, num_warps, num_stages). 64 keys (a 16 KiB bf16 K tile at
    head_dim 128, two stages in flight) for the usual head dims; fewer for tiny heads, so
    short contexts still span several tiles, and for head_dim 256, where fp32 operands would
    spill. fp8 cache tiles upcast to fp32 operands spill when pipelined (ptxas, sm_90), so
    that pairing runs one stage."""
    stages = 1 if fp8 and fp32 else 2
    if head_dim_pad <= 16:
        return 16, 4, stages
    if head_dim_pad <= 32:
        return 32, 4, stages
    if head_dim_pad <= 128:
        return 64, 4, stages
    return (16, 8, stages) if fp32 else (32, 4, stages)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new query per sequence over its paged context (incl. itself);
    with a sliding `window` W, over its last W positions only; with a `softcap` c, of the
    scores c * tanh(s / c); with `sinks` `[q_heads]`, each head's sink logit in its softmax
    denominator.

    `query` `[S, q_heads, head_dim]`; caches `[num_blocks, block_size, kv_heads, head_dim]`
    (strided views allowed, head_dim contiguous or not; the query's dtype or float8_e4m3fn);
    `block_tables` int `[S', max_blocks]` with S' >= S; `seq_lens` int `[S]`. Returns
    `[S, q_heads, head_dim]` in the query's dtype.
    `num_splits=None` picks a split count from `max_seq_len` and the batch size.
    """
    check_paged_args(query, k_cache, v_cache, block_tables, seq_lens)
    num_seqs, num_q_heads, head_dim = query.shape
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for {num_seqs} queries")
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 0:
        raise ValueError(f"max_seq_len must be a non-negative int, got {max_seq_len!r}")
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    check_softcap(softcap)
    sinks = sink_logits(sinks, query)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out

    group = num_q_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    dot_dtype, precision = dot_config(query.dtype, k_cache.dtype, _paged_decode_kernel)
    block_n, num_warps, num_stages = _tile_config(
        head_dim_pad, dot_dtype == tl.float32, k_cache.dtype == FP8
    )
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            (num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=out.device
        )
        part_lse = torch.empty(
            (num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=out.device
        )
    else:
        part_out = part_lse = out  # unused (SPLIT=False)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        out if sinks is None else sinks,  # unused without SINKS
        scale * LOG2E,
        num_splits,
        window or 0,
        (softcap or 1.0) * LOG2E,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        _combine_splits_kernel[(num_seqs, num_q_heads)](
            part_out,
            part_lse,
            out,
            part_lse if sinks is None else sinks,  # unused without SINKS
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            SINKS=sinks is not None,
            num_warps=4 if head_dim_pad * triton.next_power_of_2(num_splits) >= 2048 else 1,
        )
    return out
