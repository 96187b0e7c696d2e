"""Triton kernel that writes a step's new keys and values into their paged-cache slots.

Same contract as `kernels.torch_paged.reshape_and_cache`: `key`/`value` are
`[T, kv_heads, head_dim]`, the caches `[num_blocks, block_size, kv_heads, head_dim]` (usually
strided per-layer views of one `KvCache` tensor; only head_dim need be contiguous, and the
views are written in place), and token t goes to slot `slot_mapping[t] = block * block_size +
offset`, cast to the cache dtype. Slot -1 (padding) skips the row. An fp8 (float8_e4m3fn)
cache gets each row rounded in registers exactly as `torch_paged.to_cache_dtype` (torch's
cast after a clamp to +-448: nearest even, saturation; `triton_utils.e4m3fn_bits`); the
caller has already divided
by any k/v scale.

CUDA-graph safe: the launch reads no tensor values on the host (the grid depends only on
shapes), so slot validity is decided in the kernel. Unlike the torch reference, which raises,
a slot beyond the cache is skipped rather than reported: checking it would need a device sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import CACHE_DTYPES, SUPPORTED_DTYPES, e4m3fn_bits


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program copies BLOCK_H heads of one token's key and value into its slot (an fp8
    cache: rounded to e4m3fn on the way)."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    mask = valid & (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]

    src = token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd
    dst = (
        block * stride_kcb
        + offset * stride_kcs
        + heads[:, None] * stride_kch
        + dims[None, :] * stride_kcd
    )
    k = tl.load(key_ptr + src, mask=mask)
    tl.store(k_cache_ptr + dst, _to_cache(k, k_cache_ptr.dtype.element_ty), mask=mask)

    src = token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd
    dst = (
        block * stride_vcb
        + offset * stride_vcs
        + heads[:, None] * stride_vch
        + dims[None, :] * stride_vcd
    )
    v = tl.load(value_ptr + src, mask=mask)
    tl.store(v_cache_ptr + dst, _to_cache(v, v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _to_cache(x, dtype: tl.constexpr):
    """`x` as the cache's element type: fp8 through torch-exact rounding, others by a cast
    (decided at compile time: each cache dtype gets its own kernel)."""
    if dtype == tl.float8e4nv:
        return e4m3fn_bits(x).to(dtype, bitcast=True)
    return x.to(dtype)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key[t]`/`value[t]` to cache slot `slot_mapping[t]` (-1: skip), in place."""
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(
            f"key/value must both be [T, kv_heads, head_dim], got "
            f"{tuple(key.shape)}/{tuple(value.shape)}"
        )
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(
            f"k/v caches must both be 4-d and equal, got "
            f"{tuple(k_cache.shape)}/{tuple(v_cache.shape)}"
        )
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(
            f"key heads/dim {tuple(key.shape[1:])} != cache {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {tensor.dtype} not in {SUPPORTED_DTYPES}")
    for tensor in (k_cache, v_cache):
        if tensor.dtype not in CACHE_DTYPES:
            raise ValueError(f"cache dtype {tensor.dtype} not in {CACHE_DTYPES}")
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    block_d = triton.next_power_of_2(head_dim)
    # ~2K elements per program: all heads of a token for common sizes (8 x 128, 4 x 64).
    block_h = min(triton.next_power_of_2(num_heads), max(1, 2048 // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _reshape_and_cache_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_blocks * block_size,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )
