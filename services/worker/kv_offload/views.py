"""Byte views of block tensors: what every tier copies in and out. A block is its bytes,
whatever its dtype (float32, bf16, fp8 held as uint8)."""

from __future__ import annotations

import torch


def as_bytes(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`tensor`'s bytes as a flat uint8 tensor (a view when contiguous, else a copy);
    raises unless they are exactly `nbytes`."""
    size = tensor.numel() * tensor.element_size()
    if size != nbytes:
        raise ValueError(f"a block is {nbytes} bytes, got {size} ({tensor.dtype} {tensor.shape})")
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def out_bytes(out: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A destination's bytes as a flat uint8 view (it must be contiguous, exactly `nbytes`)."""
    if not out.is_contiguous():
        raise ValueError("a block's destination must be contiguous (it is copied into)")
    return as_bytes(out, nbytes)
