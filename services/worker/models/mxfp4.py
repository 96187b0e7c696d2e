"""MXFP4 (OCP microscaling FP4) weights as gpt-oss checkpoints store their experts, turned back
into ordinary tensors at load.

A quantized weight `W` `[..., N]` is two uint8 tensors:
- `blocks` `[..., N / 32, 16]`: 32 FP4 (e2m1) values per block, two per byte, the even
  element in the low nibble and the odd one in the high nibble. A nibble is a sign bit and
  one of the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (`FP4_VALUES`, indexed by the nibble);
- `scales` `[..., N / 32]`: one E8M0 exponent per block, biased by 127.
W[..., 32 g + i] = FP4(blocks[..., g, i // 2] nibble i % 2) * 2^(scales[..., g] - 127).

`dequantize_mxfp4` computes that in transformers' steps (`integrations.mxfp4.
_convert_moe_packed_tensors`: a lookup table in the target dtype, then `ldexp`), 16M values
at a time so the lookup indices stay small; it equals transformers' function bit for bit
(`tests/unit/test_gpt_oss.py`), without its layout change (transformers then transposes the
last two dimensions for its own expert layout).
"""

from __future__ import annotations

import torch

FP4_VALUES = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
BLOCK = 32  # values per scale
SCALE_BIAS = 127
CHUNK_VALUES = 1 << 24  # values dequantized per step (their int32 lookup indices: 64 MiB)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """`blocks` uint8 `[..., G, 16]` and `scales` uint8 `[..., G]` -> `[..., G * 32]` in
    `dtype`; ValueError for other dtypes or shapes that do not pair."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks [..., G, {BLOCK // 2}] and scales [..., G] do not pair: "
            f"{tuple(blocks.shape)} and {tuple(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    groups = blocks.shape[-2]
    rows = blocks.reshape(-1, groups, BLOCK // 2)
    exps = scales.reshape(-1, groups)
    out = torch.empty(rows.shape[0], groups, BLOCK, dtype=dtype, device=blocks.device)
    step = max(1, CHUNK_VALUES // (groups * BLOCK))
    for first in range(0, rows.shape[0], step):  # bounded int64 lookup indices
        part, chunk = out[first : first + step], rows[first : first + step]
        part[..., 0::2] = lut[(chunk & 0x0F).int()]
        part[..., 1::2] = lut[(chunk >> 4).int()]
        exponent = exps[first : first + step].int().sub_(SCALE_BIAS).unsqueeze(-1)
        torch.ldexp(part, exponent, out=part)
    return out.reshape(*blocks.shape[:-2], groups * BLOCK)
