"""Rotary position embeddings: inverse frequencies and attention factors of every supported
scaling type, exactly as transformers computes them, and the cos/sin tables the model
rotates queries and keys with.

Convention is the Hugging Face "rotate_half" one (the two halves of each head are the rotated
pairs). Frequencies are computed with transformers' own float32 operations (default, linear,
llama3, yarn, dynamic, longrope), so positions map to the same angles; yarn and longrope
scale cos and sin by their attention factor, as transformers does.

Static types (default, linear, llama3, yarn) rotate a token by its position alone: one table
indexed by position. The length-dependent ones follow transformers' `dynamic_rope_update`,
where the frequencies depend on the length of the forward call (the largest position + 1).
Under `generate` the prompt is one call and each new token another, so a token at position
p of a request with a prompt of P tokens is rotated as of length L = max(P, p + 1) — and
its cached key keeps that rotation. Tandem gives every token that L (`AttentionMetadata.
rope_lengths`), whatever the chunking or batching:

- dynamic (NTK): L <= max_position_embeddings uses the initial frequencies, a longer L those
  transformers computes for seq_len = L (precomputed here for every L up to the scaled
  maximum, `common.rope_config.scaled_max_positions`);
- longrope: L <= original_max_position_embeddings uses the short factors, a longer L the
  long ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from common.rope_config import LENGTH_DEPENDENT_ROPE_TYPES, scaled_max_positions


def inverse_frequencies(
    head_dim: int,
    theta: float,
    scaling: Mapping[str, object] | None = None,
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
) -> torch.Tensor:
    """float32 `[head_dim // 2]` inverse frequencies, equal to transformers' `ROPE_INIT_
    FUNCTIONS[type](config, seq_len=...)`. `seq_len`: the forward call's length for the
    length-dependent types (None: at initialisation); `max_position_embeddings`: needed by
    dynamic scaling."""
    rope_type = "default" if scaling is None else str(scaling.get("rope_type", "default"))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    if rope_type == "dynamic":
        if max_position_embeddings is None:
            raise ValueError("dynamic rope scaling needs max_position_embeddings")
        return _dynamic(exponents, head_dim, theta, scaling, max_position_embeddings, seq_len)
    if rope_type == "longrope":
        original = _number(scaling, "original_max_position_embeddings")
        long = seq_len is not None and seq_len > original
        factors = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / _number(scaling, "factor")
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}")


def attention_factor(scaling: Mapping[str, object] | None) -> float:
    """What transformers multiplies cos and sin by (its `attention_scaling`): yarn's and
    longrope's attention factor (given, or derived from `factor` as transformers does),
    1.0 for every other type."""
    rope_type = None if scaling is None else scaling.get("rope_type")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    given = scaling.get("attention_factor")
    if given is not None:
        return given
    factor = scaling["factor"]
    if rope_type == "longrope":
        if factor <= 1.0:
            return 1.0
        original = scaling["original_max_position_embeddings"]
        return math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


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


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, scaling: Mapping[str, object]) -> torch.Tensor:
    """transformers' `_compute_yarn_parameters`: interpolate the low frequencies by
    `factor`, keep the high ones, ramp linearly between the dimensions that turn
    `beta_fast` and `beta_slow` times over the original context."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of each dimension's original frequency
    return interpolation * (1 - keep) + extrapolation * keep


def _dynamic(exponents, dim, theta, scaling, max_positions, seq_len) -> torch.Tensor:
    """transformers' `_compute_dynamic_ntk_parameters`, in its own arithmetic: Python
    floats at initialisation (seq_len None), float32 tensor operations on a 0-dim seq_len
    in `dynamic_rope_update` (kept: vectorised kernels round pow differently)."""
    factor = scaling["factor"]
    if seq_len is None:
        seq = max_positions
    else:
        seq = torch.maximum(torch.tensor(seq_len), torch.tensor(max_positions))
    base = theta * ((factor * seq / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base**exponents)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to `[T, heads, head_dim]` queries and keys at given absolute positions
    (and, for length-dependent types, the rope length of each token)."""

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
        self.rope_type = "default" if scaling is None else str(scaling.get("rope_type"))
        self.length_dependent = self.rope_type in LENGTH_DEPENDENT_ROPE_TYPES
        self.max_positions = scaled_max_positions(scaling, max_position_embeddings)
        scale = attention_factor(scaling)

        def frequencies(seq_len: int | None = None) -> torch.Tensor:
            with torch.device("cpu"):  # (the model may be built on the meta device)
                return inverse_frequencies(
                    head_dim,
                    theta,
                    scaling,
                    max_position_embeddings=max_position_embeddings,
                    seq_len=seq_len,
                )

        # Length-dependent types: rope lengths up to `threshold` use the first table; past
        # it, the `long_*` table (longrope) or `grown_inv_freq` rows (dynamic).
        self.threshold = max_position_embeddings
        rows = max_position_embeddings
        if self.rope_type == "longrope":
            self.threshold = math.floor(_number(scaling, "original_max_position_embeddings"))
            rows = max(1, min(self.threshold, max_position_embeddings))  # positions < L <= it
            long_cos, long_sin = _table(frequencies(self.threshold + 1), max_position_embeddings)
            self.register_buffer("long_cos", long_cos * scale, persistent=False)
            self.register_buffer("long_sin", long_sin * scale, persistent=False)
        if self.rope_type == "dynamic":
            grown = [frequencies(length) for length in range(rows + 1, self.max_positions + 1)]
            grown_inv = torch.stack(grown) if grown else torch.empty(0, head_dim // 2, device="cpu")
            self.register_buffer("grown_inv_freq", grown_inv, persistent=False)
        cos, sin = _table(frequencies(), rows)
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        # Half width (both halves of a head share angles). Non-persistent: derived from the
        # config, never part of a checkpoint.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        rope_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tables = self.tables(positions, query.dtype, rope_lengths)
        return rotate(query, tables), rotate(key, tables)

    def tables(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        rope_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """(cos, sin) `[T, 1, head_dim // 2]` of the positions, in `dtype`: looked up once
        per forward pass and shared by every layer. `rope_lengths` `[T]`: the length of the
        transformers forward call each token belongs to (see the module docstring); used
        by the length-dependent types only (None: position + 1)."""
        if not self.length_dependent:
            cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        else:
            lengths = positions + 1 if rope_lengths is None else rope_lengths
            cos, sin = self._length_dependent(positions, lengths)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    def _length_dependent(
        self, positions: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row computed both ways and chosen per token: no host synchronisation, so
        this also runs inside a captured CUDA graph."""
        first = positions.clamp(max=self.cos_cache.shape[0] - 1)
        cos, sin = self.cos_cache[first], self.sin_cache[first]
        if self.rope_type == "longrope":
            long = (lengths > self.threshold).unsqueeze(-1)
            return (
                torch.where(long, self.long_cos[positions], cos),
                torch.where(long, self.long_sin[positions], sin),
            )
        if self.grown_inv_freq.shape[0] == 0:  # factor <= 1: never grows
            return cos, sin
        grown = (lengths > self.threshold).unsqueeze(-1)
        rows = (lengths - self.threshold - 1).clamp(0, self.grown_inv_freq.shape[0] - 1)
        angles = positions.float().unsqueeze(-1) * self.grown_inv_freq[rows]
        return torch.where(grown, angles.cos(), cos), torch.where(grown, angles.sin(), sin)


def _table(inv_freq: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[rows, head_dim // 2]` of positions 0..rows - 1 (float32)."""
    positions = torch.arange(rows, dtype=torch.int64, device="cpu").float()
    angles = positions[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """rotate_half form: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) for `x`
    `[T, heads, head_dim]` and `tables` from `RotaryEmbedding.tables`."""
    cos, sin = tables
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
