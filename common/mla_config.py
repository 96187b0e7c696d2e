"""The multi-head latent attention (MLA) part of a DeepSeek-V2 / V3 checkpoint's architecture,
parsed from its `config.json` as transformers v5 reads it (`DeepseekV2Config`,
`DeepseekV3Config`).

MLA compresses each token's keys and values into one latent vector `c` of `kv_lora_rank`
values (after `kv_a_layernorm`) plus one key part `k_rope` of `qk_rope_head_dim` values
shared by every head and rotated by RoPE; each head's key (`qk_nope_head_dim` values) and
value (`v_head_dim`) are up-projections of `c` through `kv_b_proj`. Tandem caches only
`[c, k_rope]` (`latent_dim` values per token and layer) and attends in the absorbed form
(`services/worker/models/deepseek.py`).

How that entry sits in the paged pool, whose blocks are `[layers, 2 (K, V), block_size,
kv_heads, head_dim]`: one KV "head" of `head_dim = latent_dim / 2`, so a block's layer holds
`2 * block_size * latent_dim / 2` values, exactly `block_size` entries, stored entry after
entry (token s's entry is values `[s * latent_dim, (s + 1) * latent_dim)` of the layer's
region, running across the K and V halves): nothing wasted, a block-table gather is one
`[blocks, block_size, latent_dim]` view, and every whole-block or whole-layer move
(transfers, shared-memory pulls, swap, copy-on-write) carries it unchanged.
`ModelConfig.num_key_value_heads` and `head_dim` are that geometry (1 and latent_dim / 2).

Also here: the attention's softmax scale (`qk_head_dim ** -0.5`, times DeepSeek's yarn
`mscale(factor, mscale_all_dim) ** 2` when the RoPE is scaled) and the rotary layout of the
RoPE part: V3's `rope_interleave` (pairs (x0, x1), (x2, x3), ... rotated, the result laid
out evens then odds: transformers' `apply_rotary_pos_emb_interleave`), V3 without it
(`rotate_half`), or V2's complex product (pairs rotated in place). Missing fields take the
config classes' defaults. Pure Python, like `common.model_config`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
INTERLEAVE, HALF, COMPLEX = "interleave", "half", "complex"  # rotary layouts of the rope part
# DeepseekV2Config / DeepseekV3Config defaults (absent keys; an explicit null stays null).
_DEFAULTS = {
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}


@dataclass(frozen=True)
class MlaConfig:
    """Latent attention sizes (see the module docstring)."""

    q_lora_rank: int | None  # None: queries through one q_proj, else q_a -> norm -> q_b
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_layout: str  # INTERLEAVE, HALF or COMPLEX
    softmax_scale: float

    def __post_init__(self) -> None:
        names = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for name in (*names, *(("q_lora_rank",) if self.q_lora_rank is not None else ())):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}"
            )
        if self.latent_dim % 2:
            raise ValueError(
                f"kv_lora_rank + qk_rope_head_dim must be even (the latent splits over the KV "
                f"cache's K and V halves), got {self.kv_lora_rank} + {self.qk_rope_head_dim}"
            )
        if self.rope_layout not in (INTERLEAVE, HALF, COMPLEX):
            raise ValueError(f"unknown MLA rope layout {self.rope_layout!r}")

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the latent, then the rotated key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def parse_mla(
    raw: Mapping[str, Any], architecture: str, rope_scaling: Mapping[str, Any] | None
) -> MlaConfig | None:
    """The MLA fields of `raw` (None for other architectures); `rope_scaling`: the parsed
    RoPE scaling (`common.rope_config.parse_rope`), which sets the softmax scale."""
    if architecture not in MLA_ARCHITECTURES:
        return None
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if kv_heads not in (None, heads):  # transformers' MLA expands the latent into every head
        raise ValueError(
            f"{architecture} with num_key_value_heads={kv_heads!r} is not supported (MLA "
            f"needs num_key_value_heads = num_attention_heads, {heads!r})"
        )
    sizes = {key: raw.get(key, default) for key, default in _DEFAULTS.items()}
    if architecture == "deepseek_v2":
        layout = COMPLEX
    else:
        interleave = raw.get("rope_interleave", True)
        if not isinstance(interleave, bool):
            raise ValueError(f"rope_interleave must be true or false, got {interleave!r}")
        layout = INTERLEAVE if interleave else HALF
    qk_head_dim = sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]
    if not all(isinstance(v, int) for k, v in sizes.items() if k != "q_lora_rank"):
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) and k != "q_lora_rank"}
        raise ValueError(f"{architecture} MLA sizes must be integers, got {bad}")
    return MlaConfig(
        q_lora_rank=sizes["q_lora_rank"],
        kv_lora_rank=sizes["kv_lora_rank"],
        qk_nope_head_dim=sizes["qk_nope_head_dim"],
        qk_rope_head_dim=sizes["qk_rope_head_dim"],
        v_head_dim=sizes["v_head_dim"],
        rope_layout=layout,
        softmax_scale=softmax_scale(qk_head_dim, rope_scaling),
    )


def softmax_scale(qk_head_dim: int, rope_scaling: Mapping[str, Any] | None) -> float:
    """transformers' `yarn_apply_mscale(rope_parameters, qk_head_dim ** -0.5)`: with scaled
    RoPE and a nonzero `mscale_all_dim`, times `(0.1 * mscale_all_dim * ln(factor) + 1) ** 2`
    (1 for a factor <= 1)."""
    scale = qk_head_dim ** (-0.5)
    if rope_scaling is None:
        return scale
    mscale_all_dim = rope_scaling.get("mscale_all_dim") or 0
    if mscale_all_dim:
        factor = rope_scaling["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale
