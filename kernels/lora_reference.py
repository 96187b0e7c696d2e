"""Plain-torch reference for batched multi-LoRA (`kernels.lora_triton.add_lora`'s contract):
slow, host-synchronising and obviously right; the Triton kernel is tested against it.

Layout: `x` `[T, in]`, `out` `[T, out]` (updated in place), `token_slots` int `[T]` (-1: the
base model, nothing added), `lora_a` `[S, in, R]`, `lora_b` `[S, R, out]` (ranks zero-padded
to R, scaling folded into B). Optional `slot_ranks` int `[S]`: only the first
`slot_ranks[s]` columns of `lora_a[s]` / rows of `lora_b[s]` count. Products run in fp32.
"""

from __future__ import annotations

import torch


def add_lora_reference(
    x: torch.Tensor,
    out: torch.Tensor,
    token_slots: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    *,
    token_order: torch.Tensor | None = None,
    slot_ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`out[t] += x[t] @ lora_a[s] @ lora_b[s]` for each token t with slot s >= 0; returns
    `out`. `token_order` (a launch hint of the kernel) does not change the result."""
    del token_order
    ranks = None if slot_ranks is None else slot_ranks.tolist()
    for slot in range(lora_a.shape[0]):
        rows = (token_slots == slot).nonzero().flatten()
        if rows.numel() == 0:
            continue
        rank = lora_a.shape[2] if ranks is None else ranks[slot]
        a = lora_a[slot, :, :rank].float()
        b = lora_b[slot, :rank].float()
        delta = x[rows].float() @ a @ b
        out[rows] = (out[rows].float() + delta).to(out.dtype)
    return out
