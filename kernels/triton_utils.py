"""Helpers shared by the Triton paged-attention kernels: argument validation for the paged
K/V caches, the choice of `tl.dot` operand dtype and precision, the in-kernel block-table
lookup that turns token positions into cache addresses, the scores' soft-cap (Gemma 2), the
check of attention sinks (gpt-oss) and the float -> fp8 (e4m3fn) rounding used when writing
an fp8 cache.

Nothing here keeps state; every function is a pure function of its arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

LOG2E = 1.4426950408889634  # kernels use exp2; softmax scales are folded by log2(e)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# `--kv-cache-dtype fp8`: a cache dtype only (queries and new K/V rows stay 16/32-bit).
FP8 = torch.float8_e4m3fn
CACHE_DTYPES = (*SUPPORTED_DTYPES, FP8)


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` runs under the Triton CPU interpreter (`TRITON_INTERPRET=1` was set
    before it was defined) rather than compiled for a GPU."""
    return isinstance(kernel, InterpretedFunction)


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    if dtype == torch.float32:
        return tl.float32
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16:
        return tl.bfloat16
    raise ValueError(f"unsupported dtype {dtype}; expected one of {SUPPORTED_DTYPES}")


def dot_config(
    query_dtype: torch.dtype, cache_dtype: torch.dtype, kernel: object
) -> tuple[tl.dtype, str]:
    """(operand dtype, input_precision) for the attention `tl.dot`s.

    On a GPU, 16-bit inputs multiply in their own dtype on the tensor cores (fp32
    accumulation; the precision flag only matters for fp32 operands). An fp8 cache counts as
    the query's dtype: the kernels upcast its tiles in registers, exactly (every e4m3 value
    is a bf16 and an fp16 value). fp32 inputs, other mixed input dtypes, and everything under
    the interpreter (whose bf16 arithmetic is wrong) use fp32 operands with exact ("ieee")
    products, so fp32 results match the reference closely.
    """
    same = cache_dtype in (query_dtype, FP8)
    if same and query_dtype != torch.float32 and not is_interpreted(kernel):
        return tl_dtype(query_dtype), "tf32"
    return tl.float32, "ieee"


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (an H100-like 132 elsewhere: the value only
    steers launch heuristics)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def check_paged_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Shape/dtype/device checks common to the attention kernels (no tensor values are read,
    so the checks never synchronise with the device)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, q_heads, head_dim], got {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k/v caches must both be [num_blocks, block_size, kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)}/{tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k/v cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query dtype {query.dtype} not in {SUPPORTED_DTYPES}")
    if k_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"cache dtype {k_cache.dtype} not in {CACHE_DTYPES}")
    if k_cache.shape[3] != query.shape[2]:
        raise ValueError(f"query head_dim {query.shape[2]} != cache head_dim {k_cache.shape[3]}")
    if query.shape[2] > 256:
        raise ValueError(f"head_dim {query.shape[2]} > 256 is not supported")
    if query.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(
            f"query heads ({query.shape[1]}) must be a multiple of kv heads ({k_cache.shape[2]})"
        )
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], got {tuple(block_tables.shape)}")
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be [S], got {tuple(seq_lens.shape)}")
    if block_tables.shape[0] < seq_lens.shape[0]:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows for {seq_lens.shape[0]} sequences"
        )
    for name, tensor in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    devices = {t.device for t in (query, k_cache, v_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


@triton.jit
def kv_block_slot(block_table_row, pos, mask, BLOCK_SIZE: tl.constexpr):
    """(block, slot), both int64, of the cache rows holding token positions `pos` of one
    sequence: position p lives in block `block_table_row[p // BLOCK_SIZE]` at slot
    `p % BLOCK_SIZE`. Masked positions read no block-table entry and map to block 0 (callers
    mask their cache loads with the same mask). int64 because block * block_stride overflows
    int32 on large caches.
    """
    block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    return block, (pos % BLOCK_SIZE).to(tl.int64)


@triton.jit
def soft_cap(scores, cap):
    """cap * tanh(scores / cap), scores and cap in the same (log2) units. Triton has no
    tanh that the interpreter runs too: tanh(x) = 1 - 2 / (e^2x + 1) (exact at both ends:
    e^2x overflows to inf or underflows to 0; near 0 within float32's step at 1, ~6e-8,
    times the cap)."""
    e2x = tl.exp2(scores * (2.0 * 1.4426950408889634 / cap))
    return cap * (1.0 - 2.0 / (e2x + 1.0))


def check_softcap(softcap: float | None) -> None:
    if softcap is None:
        return
    if isinstance(softcap, bool) or not isinstance(softcap, int | float) or not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")


def sink_logits(sinks: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
    """gpt-oss's per-head sink logits as the kernels read them (float32, contiguous, on the
    query's device), or None; ValueError unless one per query head."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (query.shape[1],):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else sinks
        raise ValueError(f"sinks must be a tensor [q_heads={query.shape[1]}], got {shape!r}")
    if not sinks.dtype.is_floating_point or sinks.device != query.device:
        raise ValueError(
            f"sinks must be floats on {query.device}, got {sinks.dtype} on {sinks.device}"
        )
    return sinks.float().contiguous()


@triton.jit
def e4m3fn_bits(x):
    """The float8_e4m3fn bytes (uint8) of `x`, rounded exactly as torch's
    `.to(torch.float8_e4m3fn)`: to nearest, ties to even; finite values beyond +-448 and
    +-inf saturate to +-448; NaN stays NaN (0x7f with x's sign). Integer arithmetic on the
    fp32 bits, identical on a GPU and under the interpreter (whose own float -> fp8 cast
    rounds ties away from zero and drops mantissa carries); the cache write it serves is
    bound by memory, not by these few integer operations.
    """
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range (|x| >= 2^-6): rebias the exponent (127 -> 7) and round the 23-bit
    # mantissa to 3 bits, half to even (0x7FFFF plus the kept mantissa's lowest bit).
    normal = (mag - (120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    normal = tl.minimum(normal, 0x7E)  # saturate (the carry into 0x7f would be NaN)
    # Below 2^-6: adding 2^14 leaves the multiples of 2^-9 (e4m3's subnormal step) as the
    # fp32 mantissa's low bits, rounded to nearest even by the fp32 addition itself.
    subnormal = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True)
    subnormal = subnormal - (141 << 23)
    code = tl.where(mag < (121 << 23), subnormal, normal)
    code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN
    return (code | sign).to(tl.uint8)
