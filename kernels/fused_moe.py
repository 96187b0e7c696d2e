"""The mixture-of-experts feed-forward in Triton, vLLM's fused-MoE design: for every token `t`
of `x` `[T, H]`, `sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))` over
`e = topk_ids[t, j]`, with every expert's weights stacked as Hugging Face stores them
(`gate_up` `[E, 2I, H]`, gate rows then up rows; `down` `[E, H, I]`), the layout
`services.worker.models.moe` keeps off CPU. It equals `moe.fused_experts` (in its
non-transposed layout) to float rounding.

1. `kernels.moe_align.align_block_size` (torch ops) groups the `T * k` assignments by expert
   and pads each expert's group to whole `BLOCK_M` blocks, so every block belongs to one
   expert (blocks past the last used one have expert -1, padding rows a sentinel).
2. One launch of `_gate_up_kernel` over (block, `I` tile): each program reads its block's
   expert, gathers the block's token rows of `x`, multiplies them by that expert's gate and
   up rows (two fp32 accumulators sharing the `x` tile), and stores `silu(gate) * up` in
   `x`'s dtype at the assignments' rows of a `[T * k, I]` scratch.
3. One launch of `_down_kernel` over (block, `H` tile): the same gather from the scratch, the
   expert's `down`, each row scaled by its routing weight (float32, on the fp32 accumulator)
   and stored at its assignment's row of `[T * k, H]`.
4. Each token's `k` rows are summed in float32 (torch), cast to `x`'s dtype.

gpt-oss's experts (`gate_up_bias` `[E, 2I]`, `down_bias` `[E, H]`, `swiglu_clamp` (alpha,
limit)): each bias joins its fp32 accumulator before the activation (gate/up) or before the
routing weight (down), and the activation is the clamped SwiGLU (up + 1) * g *
sigmoid(alpha * g) with g = min(gate, limit) and up clamped to [-limit, limit]
(`BIAS` / `CLAMPED` compile apart).

Expert parallelism: a rank holding experts `[expert_offset, expert_offset + n)` passes those
experts' weights (`gate_up[e - expert_offset]`) and the range; assignments to other experts
contribute zero (their rows are never planned; the per-assignment output starts zeroed), so
summing the ranks' outputs gives the whole layer.

Dtypes: `x` float32 / float16 / bfloat16, the weights in `x`'s dtype, `topk_weights` any
float dtype (read as float32), `topk_ids` any integer dtype. Products accumulate in float32;
fp32 operands multiply exactly ("ieee"), 16-bit ones on the tensor cores (GPU) or as fp32
(interpreter), as `triton_utils.dot_config` chooses. Weights may be strided views (e.g. a
rank's slice of the experts or of the inner dimension).

CUDA-graph safe: the wrapper reads no tensor values on the host; grids, scratch and tile
sizes depend only on shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe_align import BlockPlan, align_block_size
from kernels.triton_utils import SUPPORTED_DTYPES, dot_config, is_interpreted


@triton.jit
def _block_rows(sorted_ids_ptr, num_assignments, BLOCK_M: tl.constexpr):
    """(assignment ids, valid-row mask) of this program's block of the plan."""
    ids = tl.load(sorted_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    return ids.to(tl.int64), ids < num_assignments


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    bias_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_assignments,
    inner,
    hidden,
    alpha,
    limit,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_be,
    TOP_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,
):
    """`silu(x @ gate.T) * (x @ up.T)` for one [BLOCK_M, BLOCK_N] tile of one block's rows
    (with `BIAS`, each product plus its bias; `CLAMPED`: gpt-oss's clamped SwiGLU)."""
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < 0:  # past the plan's last block
        return
    ids, row_ok = _block_rows(sorted_ids_ptr, num_assignments, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inner
    x_rows = x_ptr + (ids // TOP_K)[:, None] * stride_xm
    gate_cols = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    up_cols = gate_cols + inner * stride_wn  # the up rows follow the gate rows
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(
            x_rows + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0
        ).to(DOT_DTYPE)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_offsets = ks.to(tl.int64)[:, None] * stride_wk
        gate = tl.load(gate_cols + w_offsets, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        up = tl.load(up_cols + w_offsets, mask=w_mask, other=0.0)
        acc_gate += tl.dot(a, gate.to(DOT_DTYPE), input_precision=PRECISION)
        acc_up += tl.dot(a, up.to(DOT_DTYPE), input_precision=PRECISION)
    if BIAS:
        bias_row = bias_ptr + expert.to(tl.int64) * stride_be
        acc_gate += tl.load(bias_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias_row + inner + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if CLAMPED:
        gate = tl.minimum(acc_gate, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out = out_ptr + ids[:, None] * stride_om + cols[None, :]
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    bias_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_assignments,
    hidden,
    inner,
    stride_hm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_be,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BIAS: tl.constexpr,
):
    """`weight * (h @ down.T)` for one [BLOCK_M, BLOCK_N] tile of one block's rows (with
    `BIAS`, `weight * (h @ down.T + bias)`)."""
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    ids, row_ok = _block_rows(sorted_ids_ptr, num_assignments, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    h_rows = h_ptr + ids[:, None] * stride_hm
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inner, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inner
        a = tl.load(h_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(
            w_cols + ks.to(tl.int64)[:, None] * stride_wk,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION)
    if BIAS:
        bias_row = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(bias_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(topk_weights_ptr + ids, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + ids[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def choose_tiles(
    num_assignments: int, num_local_experts: int, kernel: object = _gate_up_kernel
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by shape alone. BLOCK_M follows the rows an
    expert gets on average (each expert's last block is partly padding, so small batches
    take small blocks); the interpreter takes the smallest row blocks and wide column tiles
    (fewer programs). The GPU sizes are vLLM-like guesses, not yet tuned on a GPU."""
    if is_interpreted(kernel):
        return 16, 64, 64, 4
    per_expert = num_assignments / max(num_local_experts, 1)
    if per_expert <= 16:
        return 16, 64, 64, 4
    if per_expert <= 64:
        return 32, 64, 64, 4
    return 64, 128, 64, 8


def _check_gpt_oss(gate_up, down, gate_up_bias, down_bias, swiglu_clamp) -> None:
    if (gate_up_bias is None) != (down_bias is None):
        raise ValueError("gate_up_bias and down_bias come together")
    if gate_up_bias is not None:
        experts, hidden = down.shape[0], down.shape[1]
        if gate_up_bias.shape != (experts, gate_up.shape[1]) or down_bias.shape != (
            experts, hidden,
        ):  # fmt: skip
            raise ValueError(
                f"biases must be [{experts}, {gate_up.shape[1]}] and [{experts}, {hidden}], "
                f"got {tuple(gate_up_bias.shape)} and {tuple(down_bias.shape)}"
            )
        if gate_up_bias.device != gate_up.device or down_bias.device != gate_up.device:
            raise ValueError("biases must be on the weights' device")
    if swiglu_clamp is not None:
        alpha, limit = swiglu_clamp
        if not limit > 0:
            raise ValueError(f"swiglu_clamp limit must be positive, got {limit!r}")


def _check(x, gate_up, down, topk_weights, topk_ids, expert_offset, num_local) -> None:
    devices = {t.device for t in (x, gate_up, down, topk_weights, topk_ids)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x dtype {x.dtype} not in {SUPPORTED_DTYPES}")
    hidden = x.shape[1]
    if gate_up.dim() != 3 or gate_up.shape[2] != hidden or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [E, 2I, {hidden}], got {tuple(gate_up.shape)}")
    inner = gate_up.shape[1] // 2
    if down.shape != (gate_up.shape[0], hidden, inner):
        raise ValueError(
            f"down must be [{gate_up.shape[0]}, {hidden}, {inner}], got {tuple(down.shape)}"
        )
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"weights must be {x.dtype}, got {gate_up.dtype} / {down.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be [{x.shape[0]}, k], got {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} != topk_ids {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be integers, got {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point:
        raise ValueError(f"topk_weights must be floats, got {topk_weights.dtype}")
    if expert_offset < 0 or not 1 <= num_local <= gate_up.shape[0]:
        raise ValueError(
            f"expert range [{expert_offset}, {expert_offset + num_local}) does not fit the "
            f"{gate_up.shape[0]} experts held"
        )


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_offset: int = 0,
    num_local_experts: int | None = None,
    block_m: int | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu_clamp: tuple[float, float] | None = None,
) -> torch.Tensor:
    """`[T, H]`: the experts' weighted sum for every token of `x` (module docstring).
    `gate_up` / `down` hold experts `expert_offset ..` (`gate_up[e - expert_offset]` is
    expert `e`'s); only `num_local_experts` of them (default: all held) are used, and
    assignments to any other expert add nothing. `block_m`: the plan's row block (a power
    of two >= 16; default by shape). `gate_up_bias` `[E, 2I]` / `down_bias` `[E, H]` (held
    experts, together) and `swiglu_clamp` (alpha, limit): gpt-oss's experts."""
    num_local = gate_up.shape[0] if num_local_experts is None else num_local_experts
    _check(x, gate_up, down, topk_weights, topk_ids, expert_offset, num_local)
    _check_gpt_oss(gate_up, down, gate_up_bias, down_bias, swiglu_clamp)
    num_tokens, top_k = topk_ids.shape
    count = num_tokens * top_k
    if count == 0:
        return torch.zeros_like(x)
    bm, block_n, block_k, warps = choose_tiles(count, num_local)
    if block_m is not None:
        if block_m < 16 or block_m & (block_m - 1):
            raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
        bm = block_m
    plan = align_block_size(topk_ids, bm, num_local, expert_offset)
    gpt_oss = (gate_up_bias, down_bias, swiglu_clamp)
    return _launch(
        x, gate_up, down, topk_weights, plan, top_k, bm, block_n, block_k, warps, gpt_oss
    )


def _launch(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    plan: BlockPlan,
    top_k: int,
    block_m: int,
    block_n: int,
    block_k: int,
    warps: int,
    gpt_oss: tuple = (None, None, None),
) -> torch.Tensor:
    gate_up_bias, down_bias, swiglu_clamp = gpt_oss
    alpha, limit = swiglu_clamp if swiglu_clamp is not None else (1.0, 1.0)
    biased = gate_up_bias is not None
    num_tokens, hidden = x.shape
    inner = down.shape[2]
    count = plan.num_assignments
    blocks = plan.block_experts.shape[0]
    dot_dtype, precision = dot_config(x.dtype, x.dtype, _gate_up_kernel)
    scratch = torch.empty(count, inner, dtype=x.dtype, device=x.device)
    gate_up_bias = gate_up_bias.contiguous() if biased else scratch  # unused without BIAS
    down_bias = down_bias.contiguous() if biased else scratch
    _gate_up_kernel[(blocks, triton.cdiv(inner, block_n))](
        x,
        gate_up,
        scratch,
        gate_up_bias,
        plan.sorted_ids,
        plan.block_experts,
        count,
        inner,
        hidden,
        float(alpha),
        float(limit),
        x.stride(0),
        x.stride(1),
        gate_up.stride(0),
        gate_up.stride(1),
        gate_up.stride(2),
        scratch.stride(0),
        gate_up_bias.stride(0),
        TOP_K=top_k,
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BIAS=biased,
        CLAMPED=swiglu_clamp is not None,
        num_warps=warps,
    )
    rows = torch.zeros(count, hidden, dtype=x.dtype, device=x.device)  # skipped: zero
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        scratch,
        down,
        rows,
        down_bias,
        topk_weights.reshape(-1).contiguous(),
        plan.sorted_ids,
        plan.block_experts,
        count,
        hidden,
        inner,
        scratch.stride(0),
        down.stride(0),
        down.stride(1),
        down.stride(2),
        rows.stride(0),
        down_bias.stride(0),
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BIAS=biased,
        num_warps=warps,
    )
    if top_k == 1:
        return rows
    return rows.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
