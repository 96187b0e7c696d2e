"""The Gemma 2 / Gemma 3 (text) part of a checkpoint's architecture, parsed from its
`config.json` as transformers v5 reads it (`Gemma2Config`, `Gemma3TextConfig`).

What sets Gemma apart from the llama family, held as `ModelConfig.gemma`:
- the attention scale `query_pre_attn_scalar ** -0.5` (not `head_dim ** -0.5`);
- tanh soft-capping of the attention scores (`attn_logit_softcapping`, Gemma 2 only:
  transformers' Gemma 3 attention never applies it, so neither does Tandem) and of the final
  logits (`final_logit_softcapping`, both);
- Gemma 3's local RoPE: its sliding-window layers rotate with `rope_parameters
  ["sliding_attention"]` (v4 configs: `rope_local_base_freq`), its full layers with
  `rope_parameters["full_attention"]` (v4: `rope_theta` and `rope_scaling`), which
  `ModelConfig.rope_theta` / `rope_scaling` then hold;
- which layers are "sliding_attention" (`layer_types`, else Gemma 2's every other layer or
  Gemma 3's `sliding_window_pattern`; `common.sliding_window.gemma_layer_types`).
The activation must be `hidden_activation: gelu_pytorch_tanh` (GeGLU), the one both use.

`with_defaults` fills in the config classes' defaults for fields that `config.json` leaves
out (`head_dim` 256, tied embeddings, the soft-caps, ...), as transformers would. What Tandem
does not compute (bidirectional attention, another activation, length-dependent RoPE on
Gemma 3) is a `ValueError` naming the field. Pure Python, like `common.model_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.rope_config import LENGTH_DEPENDENT_ROPE_TYPES, Scaling, parse_rope
from common.sliding_window import FULL, SLIDING, gemma_layer_types

GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")
ACTIVATION = "gelu_pytorch_tanh"
_GEMMA3_GLOBAL_THETA, _GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma3TextConfig's
# The config classes' defaults for what changes the computation (a key present with null
# stays null, as in transformers).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        "head_dim": 256,
        "hidden_activation": ACTIVATION,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
    "gemma3_text": {
        "head_dim": 256,
        "hidden_activation": ACTIVATION,
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
}


@dataclass(frozen=True)
class GemmaConfig:
    """Gemma's departures from the llama-family decoder (see the module docstring)."""

    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None  # tanh cap of attention scores; None: none
    final_logit_softcapping: float | None  # tanh cap of the logits; None: none
    # Per decoder layer: a "sliding_attention" layer (Gemma 3: rotated by the local RoPE).
    sliding_layers: tuple[bool, ...] = ()
    # Gemma 3's sliding layers' RoPE; None (Gemma 2): every layer rotates alike.
    local_rope_theta: float | None = None
    local_rope_scaling: Scaling | None = None

    def __post_init__(self) -> None:
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is None and name != "query_pre_attn_scalar":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                kind = "a positive number" + ("" if name == "query_pre_attn_scalar" else " or null")
                raise ValueError(f"{name} must be {kind}, got {value!r}")

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    def local_rope(self, layer: int) -> bool:
        """Whether decoder layer `layer` rotates with the local (sliding-layer) RoPE."""
        return self.local_rope_theta is not None and self.sliding_layers[layer]


def with_defaults(raw: Mapping[str, Any], architecture: str) -> dict[str, Any]:
    """`raw` with the config class's defaults where it has no such key."""
    return {**_DEFAULTS[architecture], **raw}


def parse_gemma(raw: Mapping[str, Any], architecture: str) -> GemmaConfig | None:
    """The Gemma fields of `raw` (after `with_defaults`); None for other architectures."""
    if architecture not in GEMMA_ARCHITECTURES:
        return None
    activation = raw.get("hidden_activation")
    if activation != ACTIVATION:
        raise ValueError(
            f"{architecture} with hidden_activation={activation!r} is not supported "
            f"(only {ACTIVATION!r})"
        )
    if raw.get("use_bidirectional_attention"):
        raise ValueError(
            f"{architecture} with use_bidirectional_attention=true is not supported "
            f"(causal attention only)"
        )
    num_layers = raw.get("num_hidden_layers")
    sliding = tuple(t == SLIDING for t in gemma_layer_types(raw, architecture, num_layers))
    local_theta = local_scaling = None
    if architecture == "gemma3_text":
        local = _gemma3_rope_parameters(raw)[SLIDING]
        local_theta, local_scaling = parse_rope(
            _rope_raw(raw, local), raw["max_position_embeddings"]
        )
    return GemmaConfig(
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
        attn_logit_softcapping=(
            raw.get("attn_logit_softcapping") if architecture == "gemma2" else None
        ),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        sliding_layers=sliding,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )


def global_rope_raw(raw: Mapping[str, Any], architecture: str) -> Mapping[str, Any]:
    """What `common.rope_config.parse_rope` reads for the model's (full layers') RoPE: `raw`
    itself, except for Gemma 3, whose full layers take `rope_parameters["full_attention"]`."""
    if architecture != "gemma3_text":
        return raw
    return _rope_raw(raw, _gemma3_rope_parameters(raw)[FULL])


def _rope_raw(raw: Mapping[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    out = {"rope_parameters": params, "max_position_embeddings": raw["max_position_embeddings"]}
    if "partial_rotary_factor" in raw:
        out["partial_rotary_factor"] = raw["partial_rotary_factor"]
    return out


def _gemma3_rope_parameters(raw: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each layer type's RoPE parameters, as `Gemma3TextConfig.convert_rope_params_to_dict`
    makes them: `rope_parameters` by layer type (v5), or the defaults with v4's
    `rope_scaling` over the full layers', `rope_theta` the full layers' theta and
    `rope_local_base_freq` the sliding layers'. Length-dependent types are refused."""
    given = raw.get("rope_parameters")
    if given is not None:
        if not isinstance(given, Mapping) or not set(given) <= {FULL, SLIDING}:
            raise ValueError(
                f"gemma3_text rope_parameters must be given per layer type ({FULL}, "
                f"{SLIDING}), got {given!r}"
            )
    params = {k: dict(v) if isinstance(v, Mapping) else v for k, v in (given or {}).items()}
    if given is None:
        params = {SLIDING: {"rope_type": "default"}, FULL: {"rope_type": "default"}}
    scaling = raw.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, Mapping):
            raise ValueError(f"rope_scaling must be a JSON object, got {scaling!r}")
        params[FULL] = {**(params.get(FULL) or {}), **scaling}
    if params.get(FULL) is None:
        params[FULL] = {"rope_type": "default"}
    params[FULL].setdefault("rope_theta", raw.get("rope_theta", _GEMMA3_GLOBAL_THETA))
    if params.get(SLIDING) is None:
        params[SLIDING] = {"rope_type": "default"}
    params[SLIDING].setdefault("rope_theta", raw.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA))
    for layer_type, layer_params in params.items():
        if not isinstance(layer_params, Mapping):
            raise ValueError(f"rope_parameters[{layer_type!r}] must be a JSON object")
        rope_type = layer_params.get("rope_type") or layer_params.get("type") or "default"
        if rope_type in LENGTH_DEPENDENT_ROPE_TYPES:
            raise ValueError(
                f"gemma3_text {layer_type} rope type {rope_type!r} is not supported "
                f"(static types only)"
            )
    return params
