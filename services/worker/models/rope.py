"""Rotary position embeddings: inverse frequencies for the supported scaling types and a
precomputed cos/sin table indexed by absolute position.

Convention is the Hugging Face "rotate_half" one (the two halves of each head are the rotated
pairs). Frequencies are computed the same way transformers computes them (float32, same
formulas for default, linear and llama3 scaling) so positions map to bit-identical angles.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn


def inverse_frequencies(
    head_dim: int, theta: float, scaling: Mapping[str, object] | None = None
) -> torch.Tensor:
    """float32 `[head_dim // 2]` inverse frequencies, with optional linear/llama3 scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = "default" if scaling is None else str(scaling.get("rope_type", "default"))
    if scaling is None or rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / _number(scaling, "factor")
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}")


def _number(scaling: Mapping[str, object], key: str) -> float:
    value = scaling.get(key)
    if not isinstance(value, int | float):
        raise ValueError(f"rope scaling needs a numeric {key!r}, got {value!r}")
    return float(value)


def _llama3_scale(inv_freq: torch.Tensor, scaling: Mapping[str, object]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = _number(scaling, "factor")
    low = _number(scaling, "low_freq_factor")
    high = _number(scaling, "high_freq_factor")
    original_len = _number(scaling, "original_max_position_embeddings")
    low_freq_wavelen = original_len / low
    high_freq_wavelen = original_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_between, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to `[T, heads, head_dim]` queries and keys at given absolute positions."""

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        theta: float,
        scaling: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_position_embeddings, dtype=torch.int64, device="cpu").float()
        angles = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        # Half width (both halves of a head share angles). Non-persistent: derived from the
        # config, never part of a checkpoint.
        self.register_buffer("cos_cache", angles.cos(), persistent=False)
        self.register_buffer("sin_cache", angles.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tables = self.tables(positions, query.dtype)
        return rotate(query, tables), rotate(key, tables)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(cos, sin) `[T, 1, head_dim // 2]` of the positions, in `dtype`: looked up once
        per forward pass and shared by every layer."""
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        return cos, sin


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """rotate_half form: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) for `x`
    `[T, heads, head_dim]` and `tables` from `RotaryEmbedding.tables`."""
    cos, sin = tables
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
