"""Triton kernels for batched multi-LoRA (Punica / S-LoRA's idea): every token of a step
goes through its own adapter's low-rank update, all adapters in one launch per stage.

Contract (same as `kernels.lora_reference.add_lora_reference`): `x` `[T, in]`, `out`
`[T, out]` updated in place, `token_slots` int `[T]` (-1: base model, nothing added; a slot
outside `0..S-1` is skipped too), stacked `lora_a` `[S, in, R]` and `lora_b` `[S, R, out]`
(each slot's rank zero-padded to R, scaling folded into B); `out[t] += x[t] @ lora_a[s] @
lora_b[s]`. Optional hints: `token_order` (the tokens sorted by slot, see below) and
`slot_ranks` int `[S]` (columns/rows beyond a slot's rank are skipped; rank 0: no work).

Two stages, not one fused kernel: "shrink" `y = x @ A_s` reduces over the large `in` dim
into a tiny fp32 `[T, R]`; "expand" `out += y @ B_s` fans out over the large `out` dim. Fused,
a program would have to finish the whole `in` reduction before expanding, so a decode step
(few tokens) would get a handful of programs; split, shrink cuts `in` into SPLIT_K ranges
(partials in `[SPLIT_K, T, R]` scratch, summed by expand in a fixed order: deterministic, no
atomics) and expand tiles `out`, so both fill the GPU. The `[T, R]` round trip is negligible.

Grid: (token tile, slot, split or out tile). Tokens are visited in `token_order` (sorted by
slot, stable) so a tile mostly holds one adapter; a program handles the tile's tokens of its
slot (masked rows; a tile without them costs one small load), gathering x rows and
scattering into `out` rows by token index. Each token is written by exactly one expand
program, so the in-place add needs no atomics. `tl.dot` tiles are >= 16 in every dim
(padded, masked) and accumulate in fp32; fp32 operands multiply exactly ("ieee").

CUDA-graph safe: the launch reads no tensor values on the host; grid, scratch and tile
sizes depend only on shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import SUPPORTED_DTYPES, dot_config, num_sms

MAX_SPLIT_K = 16
MIN_SPLIT_BLOCKS = 4  # K blocks each split must get at least


@triton.jit
def _token_tile(slots_ptr, order_ptr, ranks_ptr, num_tokens, slot, R, HAS_RANKS, BLOCK_M):
    """(positions, token indices, rows of this slot, its rank) of one tile of sorted tokens."""
    pos = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_range = pos < num_tokens
    tokens = tl.load(order_ptr + pos, mask=in_range, other=0).to(tl.int64)
    token_slot = tl.load(slots_ptr + tokens, mask=in_range, other=-1)
    active = in_range & (token_slot == slot)
    rank = R
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + slot).to(tl.int32), R)
    return pos, tokens, active, rank


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    slots_ptr,
    order_ptr,
    ranks_ptr,
    num_tokens,
    K,
    R,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ak,
    stride_ar,
    stride_ys,
    stride_yt,
    HAS_RANKS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """y[split, pos] = x[token] @ A_slot over this split's range of `in`, for one tile of
    sorted tokens and one slot."""
    slot = tl.program_id(1)
    split = tl.program_id(2)
    pos, tokens, active, rank = _token_tile(
        slots_ptr, order_ptr, ranks_ptr, num_tokens, slot, R, HAS_RANKS, BLOCK_M
    )
    if (tl.max(active.to(tl.int32), axis=0) > 0) & (rank > 0):
        r = tl.arange(0, BLOCK_R)
        r_mask = r < rank
        per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_start = split * per_split
        k_end = tl.minimum(K, k_start + per_split)
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < k_end
            xs = tl.load(
                x_ptr + tokens[:, None] * stride_xt + k[None, :] * stride_xk,
                mask=active[:, None] & k_mask[None, :],
                other=0.0,
            )
            a = tl.load(
                a_base + k[:, None] * stride_ak + r[None, :] * stride_ar,
                mask=k_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            acc = tl.dot(xs.to(DOT_DTYPE), a.to(DOT_DTYPE), acc, input_precision=PRECISION)
        y = y_ptr + split * stride_ys + pos.to(tl.int64)[:, None] * stride_yt + r[None, :]
        tl.store(y, acc, mask=active[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    slots_ptr,
    order_ptr,
    ranks_ptr,
    num_tokens,
    N,
    R,
    stride_ys,
    stride_yt,
    stride_bs,
    stride_br,
    stride_bn,
    stride_ot,
    stride_on,
    HAS_RANKS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[token, n tile] += (sum of y's splits)[pos] @ B_slot, for one tile of sorted tokens
    and one slot."""
    slot = tl.program_id(1)
    pos, tokens, active, rank = _token_tile(
        slots_ptr, order_ptr, ranks_ptr, num_tokens, slot, R, HAS_RANKS, BLOCK_M
    )
    if (tl.max(active.to(tl.int32), axis=0) > 0) & (rank > 0):
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < N
        b_base = b_ptr + slot.to(tl.int64) * stride_bs
        y_rows = y_ptr + pos.to(tl.int64)[:, None] * stride_yt
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_mask = r < rank
            y_mask = active[:, None] & r_mask[None, :]
            y = tl.load(y_rows + r[None, :], mask=y_mask, other=0.0)
            for split in range(1, SPLIT_K):
                y += tl.load(y_rows + split * stride_ys + r[None, :], mask=y_mask, other=0.0)
            b = tl.load(
                b_base + r[:, None] * stride_br + n[None, :] * stride_bn,
                mask=r_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            acc = tl.dot(y.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision=PRECISION)
        dst = out_ptr + tokens[:, None] * stride_ot + n[None, :] * stride_on
        mask = active[:, None] & n_mask[None, :]
        cur = tl.load(dst, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst, (cur + acc).to(out_ptr.dtype.element_ty), mask=mask)


def add_lora(
    x: torch.Tensor,
    out: torch.Tensor,
    token_slots: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    *,
    token_order: torch.Tensor | None = None,
    slot_ranks: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """`out[t] += x[t] @ lora_a[s] @ lora_b[s]` for every token t whose slot s >= 0, in
    place; returns `out`. `token_order`: the token indices sorted by slot (computed on the
    device when omitted; a caller running many layers per pass passes it once). `split_k`
    overrides the shrink stage's split of `in` (tests)."""
    _check_args(x, out, token_slots, lora_a, lora_b, token_order, slot_ranks)
    num_tokens, in_features = x.shape
    num_slots, _, rank = lora_a.shape
    out_features = out.shape[1]
    if num_tokens == 0 or num_slots == 0 or rank == 0:
        return out
    if token_order is None:
        token_order = torch.argsort(token_slots, stable=True)
    ranks = token_slots if slot_ranks is None else slot_ranks  # unused without HAS_RANKS

    block_r = max(16, triton.next_power_of_2(rank))
    block_m = max(16, min(64, triton.next_power_of_2(num_tokens), 8192 // block_r))
    block_k = max(16, min(64, 8192 // block_r))
    m_tiles = triton.cdiv(num_tokens, block_m)
    if split_k is None:
        split_k = choose_split_k(m_tiles, in_features, block_k, x.device)
    if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"split_k must be a positive int, got {split_k!r}")
    y = torch.empty((split_k, num_tokens, rank), dtype=torch.float32, device=x.device)
    dot_dtype, precision = dot_config(x.dtype, lora_a.dtype, _shrink_kernel)
    _shrink_kernel[(m_tiles, num_slots, split_k)](
        x,
        lora_a,
        y,
        token_slots,
        token_order,
        ranks,
        num_tokens,
        in_features,
        rank,
        *x.stride(),
        *lora_a.stride(),
        *y.stride()[:2],
        HAS_RANKS=slot_ranks is not None,
        SPLIT_K=split_k,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        BLOCK_R=block_r,
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        num_warps=4,
    )

    block_m = max(16, min(64, triton.next_power_of_2(num_tokens)))
    dot_dtype, precision = dot_config(lora_b.dtype, lora_b.dtype, _expand_kernel)
    block_n = 64 if dot_dtype == tl.float32 else 128
    grid = (triton.cdiv(num_tokens, block_m), num_slots, triton.cdiv(out_features, block_n))
    _expand_kernel[grid](
        y,
        lora_b,
        out,
        token_slots,
        token_order,
        ranks,
        num_tokens,
        out_features,
        rank,
        *y.stride()[:2],
        *lora_b.stride(),
        *out.stride(),
        HAS_RANKS=slot_ranks is not None,
        SPLIT_K=split_k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=min(block_r, 64),
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        num_warps=4,
    )
    return out


def choose_split_k(m_tiles: int, in_features: int, block_k: int, device: torch.device) -> int:
    """Splits of the shrink stage's `in` reduction: enough programs to fill the GPU when the
    step has few token tiles, but every split keeps >= MIN_SPLIT_BLOCKS blocks of `in`."""
    by_work = triton.cdiv(in_features, block_k * MIN_SPLIT_BLOCKS)
    by_occupancy = max(1, num_sms(device) // m_tiles)
    return max(1, min(MAX_SPLIT_K, by_work, by_occupancy))


def _check_args(x, out, token_slots, lora_a, lora_b, token_order, slot_ranks) -> None:
    """Shapes, dtypes and devices only: no tensor values are read (no device sync)."""
    if x.dim() != 2 or out.dim() != 2 or x.shape[0] != out.shape[0]:
        raise ValueError(f"x [T, in] and out [T, out] expected, got {tuple(x.shape)}, "
                         f"{tuple(out.shape)}")  # fmt: skip
    if lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError(f"lora_a [S, in, R] and lora_b [S, R, out] expected, got "
                         f"{tuple(lora_a.shape)}, {tuple(lora_b.shape)}")  # fmt: skip
    num_slots, in_features, rank = lora_a.shape
    if lora_a.shape[1] != x.shape[1] or lora_b.shape != (num_slots, rank, out.shape[1]):
        raise ValueError(
            f"x {tuple(x.shape)}, out {tuple(out.shape)}, lora_a {tuple(lora_a.shape)} and "
            f"lora_b {tuple(lora_b.shape)} do not fit [T, in], [T, out], [S, in, R], [S, R, out]"
        )
    for name, tensor in (("x", x), ("out", out), ("lora_a", lora_a), ("lora_b", lora_b)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {tensor.dtype} not in {SUPPORTED_DTYPES}")
    for name, tensor, size in (
        ("token_slots", token_slots, x.shape[0]),
        ("token_order", token_order, x.shape[0]),
        ("slot_ranks", slot_ranks, num_slots),
    ):
        if tensor is None:
            continue
        if tensor.dim() != 1 or tensor.shape[0] != size:
            raise ValueError(f"{name} must be [{size}], got {tuple(tensor.shape)}")
        if tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    tensors = [x, out, token_slots, lora_a, lora_b, token_order, slot_ranks]
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
