"""OpenAI's gpt-oss (`GptOssForCausalLM`, model_type `gpt_oss`): the defaults transformers v5's
`GptOssConfig` fills in for fields a `config.json` leaves out, and what Tandem refuses.

gpt-oss is a mixture-of-experts decoder; `ModelConfig` describes it with the llama family's
fields, its `moe` (`gpt_oss_moe`) and `GptOssConfig` (`ModelConfig.gpt_oss`):
- attention: q/k/v/o biases (`attention_bias`, default true), per-head attention sinks
  (always; weights, not config), `layer_types` alternating "sliding_attention" /
  "full_attention" from layer 0 (`common.sliding_window`), a window of `sliding_window`
  (default 128), YaRN RoPE (default factor 32 over 4096 positions, theta 150000,
  `truncate` false);
- experts (`common.moe_config.MoeConfig`): `num_local_experts` (or `num_experts`), top
  `num_experts_per_tok` of the router's biased logits softmaxed over those k, biased experts
  of inner size `intermediate_size` with the clamped SwiGLU (`swiglu_alpha` 1.702,
  `swiglu_limit` 7.0: `GptOssConfig`); every layer is sparse.
Checkpoints may store the experts in MXFP4 (`quantization_config.quant_method` "mxfp4",
dequantized at load by the worker); any other `quant_method` is refused there. Pure Python,
like `common.model_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.moe_config import MoeConfig

GPT_OSS = "gpt_oss"
_DEFAULT_THETA = 150_000.0  # GptOssConfig.default_theta
# GptOssConfig's class defaults (a key present with null stays null, as in transformers).
_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "vocab_size": 201_088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
}
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def gpt_oss_defaults(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` with `GptOssConfig`'s defaults for the fields it lacks: sizes, window, biases,
    SwiGLU clamp, and YaRN RoPE when it names no RoPE at all (theta 150000 when absent)."""
    out = {**_DEFAULTS, **raw}
    if "num_experts" in raw and "num_local_experts" not in raw:
        out["num_local_experts"] = raw["num_experts"]  # GptOssConfig's attribute map
    if not raw.get("rope_parameters") and not raw.get("rope_scaling"):
        out["rope_parameters"] = dict(_DEFAULT_ROPE)
    params = out.get("rope_parameters") or out.get("rope_scaling")
    in_params = isinstance(params, Mapping) and "rope_theta" in params
    if "rope_theta" not in raw and not in_params:
        out["rope_theta"] = _DEFAULT_THETA
    return out


@dataclass(frozen=True)
class GptOssConfig:
    """The experts' clamped SwiGLU: (up + 1) * g * sigmoid(alpha * g) with g = min(gate,
    limit) and up clamped to [-limit, limit]."""

    swiglu_alpha: float
    swiglu_limit: float

    def __post_init__(self) -> None:
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"gpt_oss {name} must be a number, got {value!r}")
        if not self.swiglu_limit > 0:
            raise ValueError(f"gpt_oss swiglu_limit must be positive, got {self.swiglu_limit!r}")


def parse_gpt_oss(raw: Mapping[str, Any], architecture: str) -> GptOssConfig | None:
    """gpt-oss's settings of a `config.json` (after `gpt_oss_defaults`); None for others."""
    if architecture != GPT_OSS:
        return None
    return GptOssConfig(raw.get("swiglu_alpha"), raw.get("swiglu_limit"))


def gpt_oss_moe(raw: Mapping[str, Any]) -> MoeConfig:
    """gpt-oss's experts: every layer sparse; the top-k weights sum to 1 (a softmax over the
    k chosen logits)."""
    for name in ("num_local_experts", "num_experts_per_tok", "intermediate_size"):
        value = raw.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"config.json field {name!r} must be a positive integer, got {value!r}"
            )
    return MoeConfig(
        num_experts=raw["num_local_experts"],
        num_experts_per_tok=raw["num_experts_per_tok"],
        expert_intermediate_size=raw["intermediate_size"],
        norm_topk_prob=True,
    )
