"""Weight-only quantized matmuls in Triton: `y = x @ W.T (+ bias)` with `x` `[T, in]` in
float32 / float16 / bfloat16 and `W` kept packed in memory, dequantized tile by tile in
registers, multiplied with fp32 accumulation; `y` has `x`'s dtype.

- `gptq_matmul`: `qweight` int32 `[in / pack, out]` (pack = 32 / bits values per word,
  lowest bits first; bits 4 or 8), `qzeros` int32 `[groups, out / pack]`, `scales`
  `[groups, out]`, optional `g_idx` `[in]` (each input row's group; `i // group_size` when
  None); W[o, i] = scales[g, o] * (q[i, o] - (zero[g, o] + zero_offset)), g = g_idx[i].
- `fp8_matmul`: `weight` float8_e4m3fn `[out, in]`, `scale` one value or one per output row
  (`[out]` or `[out, 1]`), applied to the accumulated dot products.
- `gptq_reference`, `fp8_reference`: the same products in plain torch (dequantize, then
  matmul), which the kernels are tested against.

Each program computes one `[BLOCK_M, BLOCK_N]` output tile, looping over the input in
`BLOCK_K` steps; edges are masked, so any shape works. Without `g_idx`, when a group spans
whole `BLOCK_K` steps, a step reads one scales / zeros row; otherwise (act-order) each input
row gathers its own. The wrappers read no tensor values on the host (CUDA-graph safe); the
launch configuration depends on shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import SUPPORTED_DTYPES, dot_config, is_interpreted


@triton.jit
def _gptq_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    g_idx_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_om,
    BITS: tl.constexpr,
    ZERO_OFFSET: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    ROW_GROUPS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of x @ W.T; ROW_GROUPS: every input row of a K step
    looks its group up (act-order, or groups that do not span whole steps)."""
    PACK: tl.constexpr = 32 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    n_words = (N + PACK - 1) // PACK  # qzeros columns
    zero_shift = (cols % PACK) * BITS
    zero_cols = cols // PACK
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            x_rows + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w_mask = k_ok[:, None] & col_ok[None, :]
        words = tl.load(
            qweight_ptr + (ks // PACK).to(tl.int64)[:, None] * N + cols[None, :],
            mask=w_mask,
            other=0,
        )
        q = (words >> ((ks % PACK) * BITS)[:, None]) & LEVELS  # [BLOCK_K, BLOCK_N]
        if ROW_GROUPS:
            if HAS_GIDX:
                groups = tl.load(g_idx_ptr + ks, mask=k_ok, other=0).to(tl.int64)
            else:
                groups = (ks // GROUP_SIZE).to(tl.int64)
            scale = tl.load(
                scales_ptr + groups[:, None] * N + cols[None, :], mask=w_mask, other=0.0
            )
            zero_words = tl.load(
                qzeros_ptr + groups[:, None] * n_words + zero_cols[None, :], mask=w_mask, other=0
            )
            zeros = ((zero_words >> zero_shift[None, :]) & LEVELS) + ZERO_OFFSET
        else:  # the whole step lies in one group: one scales / zeros row
            group = k0 // GROUP_SIZE  # groups * N stays far below 2**31
            scale = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0)[None, :]
            zero_words = tl.load(qzeros_ptr + group * n_words + zero_cols, mask=col_ok, other=0)
            zeros = (((zero_words >> zero_shift) & LEVELS) + ZERO_OFFSET)[None, :]
        w = ((q - zeros).to(tl.float32) * scale.to(tl.float32)).to(DOT_DTYPE)
        acc += tl.dot(a.to(DOT_DTYPE), w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _e4m3_bits_to_f32(bits):
    """float8 e4m3fn bytes (as uint8) -> float32 by bit arithmetic, for GPUs without native
    fp8 conversions (NaN codes are not special-cased: checkpoints hold none)."""
    b = bits.to(tl.int32)
    sign = b >> 7
    exponent = (b >> 3) & 15
    mantissa = b & 7
    normal = ((sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(
        tl.float32, bitcast=True
    )
    subnormal = mantissa.to(tl.float32) * 0.001953125 * (1.0 - 2.0 * sign.to(tl.float32))
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def _fp8_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_om,
    PER_CHANNEL: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of (x @ weight.T) * scale; `w_ptr` points at float8
    (NATIVE_FP8) or at the same bytes as uint8."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            x_rows + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w_mask = k_ok[:, None] & col_ok[None, :]
        raw = tl.load(w_cols + ks[:, None], mask=w_mask)  # masked lanes: zeroed below
        w = raw.to(tl.float32) if NATIVE_FP8 else _e4m3_bits_to_f32(raw)  # [BLOCK_K, BLOCK_N]
        w = tl.where(w_mask, w, 0.0)
        acc += tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION)
    if PER_CHANNEL:
        acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    else:
        acc *= tl.load(scale_ptr).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _tiles(rows: int, cols: int, kernel: object) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by shape alone. Decode-sized batches take
    narrow column tiles (more programs to stream the weight); prefill wider ones, so each
    dequantized tile serves more rows. The interpreter takes few, large tiles."""
    if is_interpreted(kernel):
        return max(16, min(64, triton.next_power_of_2(rows))), 64, 64, 4
    if rows <= 16:
        return 16, 32 if cols <= 16384 else 64, 128, 4
    if rows <= 64:
        return triton.next_power_of_2(rows), 64, 64, 4
    return 64, 128, 64, 8


def _check_x(x: torch.Tensor, in_features: int, bias, out: int, *weights) -> None:
    devices = {t.device for t in (x, bias, *weights) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [T, {in_features}], got {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x dtype {x.dtype} not in {SUPPORTED_DTYPES}")
    if bias is not None and (bias.shape != (out,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{out}], got {tuple(bias.shape)}")


def gptq_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    zero_offset: int = 0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ W.T (+ bias)` for one GPTQ layer (module docstring); `x` `[T, in]` with
    in = qweight rows * pack; `group_size` <= 0: one group (unused with `g_idx`)."""
    if bits not in (4, 8):
        raise ValueError(f"gptq bits must be 4 or 8, got {bits}")
    pack = 32 // bits
    words, out_features = qweight.shape
    in_features = words * pack
    _check_x(x, in_features, bias, out_features, qweight, qzeros, scales, g_idx)
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight / qzeros must be int32, got {qweight.dtype} / {qzeros.dtype}")
    if scales.shape[1] != out_features or qzeros.shape != (
        scales.shape[0],
        -(-out_features // pack),
    ):
        raise ValueError(
            f"gptq shapes disagree: qweight {tuple(qweight.shape)} (x{pack}), qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}"
        )
    if not (qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()):
        raise ValueError("qweight, qzeros and scales must be contiguous")
    if g_idx is not None and (g_idx.shape != (in_features,) or not g_idx.is_contiguous()):
        raise ValueError(f"g_idx must be a contiguous [{in_features}], got {tuple(g_idx.shape)}")
    group = group_size if group_size > 0 else in_features
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block_m, block_n, block_k, warps = _tiles(x.shape[0], out_features, _gptq_kernel)
    if g_idx is None and group % block_k and group % 16 == 0:
        block_k = 1 << ((group & -group).bit_length() - 1)  # a power of two dividing group
        block_k = min(block_k, 128)
    row_groups = g_idx is not None or group % block_k != 0
    dot_dtype, precision = dot_config(x.dtype, x.dtype, _gptq_kernel)
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(out_features, block_n))
    _gptq_kernel[grid](
        x,
        qweight,
        qzeros,
        scales,
        qweight if g_idx is None else g_idx,
        out if bias is None else bias,
        out,
        x.shape[0],
        out_features,
        in_features,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        BITS=bits,
        ZERO_OFFSET=zero_offset,
        GROUP_SIZE=group,
        HAS_GIDX=g_idx is not None,
        ROW_GROUPS=row_groups,
        HAS_BIAS=bias is not None,
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return out


def native_fp8(device: torch.device) -> bool:
    """Whether the kernel can convert float8 e4m3 in hardware (CUDA compute capability 8.9+;
    the interpreter too); otherwise it decodes the bits itself."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    native: bool | None = None,
) -> torch.Tensor:
    """`(x @ weight.T) * scale (+ bias)` for one FP8 layer (module docstring); `native`:
    convert float8 in hardware (default: where the device can)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be a row-major float8_e4m3fn [out, in], got {weight.dtype}")
    out_features, in_features = weight.shape
    _check_x(x, in_features, bias, out_features, weight, scale)
    if scale.numel() not in (1, out_features) or not scale.is_contiguous():
        raise ValueError(
            f"scale must be one value or one per output row ({out_features}), got "
            f"{tuple(scale.shape)}"
        )
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    native = native_fp8(weight.device) if native is None else native
    block_m, block_n, block_k, warps = _tiles(x.shape[0], out_features, _fp8_kernel)
    dot_dtype, precision = dot_config(x.dtype, x.dtype, _fp8_kernel)
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(out_features, block_n))
    _fp8_kernel[grid](
        x,
        weight if native else weight.view(torch.uint8),
        scale,
        out if bias is None else bias,
        out,
        x.shape[0],
        out_features,
        in_features,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        out.stride(0),
        PER_CHANNEL=scale.numel() != 1,
        NATIVE_FP8=native,
        HAS_BIAS=bias is not None,
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return out


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    return (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def gptq_reference(x, qweight, qzeros, scales, g_idx, bits, group_size, zero_offset=0, bias=None):
    """`gptq_matmul` in plain torch: the dense float32 weight, then one matmul."""
    q = _unpack(qweight, bits).permute(0, 2, 1).reshape(-1, qweight.shape[1])  # [in, out]
    zeros = _unpack(qzeros, bits).reshape(qzeros.shape[0], -1)[:, : qweight.shape[1]]
    if g_idx is None:
        group = group_size if group_size > 0 else q.shape[0]
        g_idx = torch.arange(q.shape[0], device=q.device) // group
    g_idx = g_idx.long()
    weight = (q - zeros[g_idx] - zero_offset).float() * scales.float()[g_idx]
    return _finish(x.float() @ weight, bias, x.dtype)


def fp8_reference(x, weight, scale, bias=None):
    """`fp8_matmul` in plain torch."""
    dense = weight.float() * scale.float().reshape(-1, 1)
    return _finish(x.float() @ dense.t(), bias, x.dtype)


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return (y if bias is None else y + bias.float()).to(dtype)
