"""The mixture-of-experts part of a checkpoint's architecture (Mixtral, Qwen3-MoE), parsed and
validated from its `config.json`.

`MoeConfig` says how many routed experts each sparse layer has, how many of them a token
goes through, their inner size, whether the top-k routing weights are renormalised, and
which decoder layers are sparse (Qwen3-MoE's `decoder_sparse_step` and `mlp_only_layers`:
the others keep a dense MLP of `intermediate_size`; Mixtral's layers are all sparse).
Whatever Tandem's expert computation does not implement (shared experts as in qwen2_moe or
DeepSeek, grouped routing, a top-k larger than the expert count, missing sizes) is a
`ValueError` naming the field, before any weight is read. Pure Python, like
`common.model_config`, which holds one of these as `ModelConfig.moe`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")
# Fields of other MoE families whose experts Tandem does not compute: refused when set.
_UNSUPPORTED_FIELDS = (
    "shared_expert_intermediate_size",  # qwen2_moe's shared expert
    "n_shared_experts",  # DeepSeek / GLM-MoE
    "num_shared_experts",
    "n_group",  # grouped top-k routing
    "topk_group",
    "moe_layer_freq",
    "first_k_dense_replace",
)


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts of the sparse decoder layers."""

    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int  # each expert's inner (gate/up) size
    norm_topk_prob: bool  # renormalise the top-k softmax weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and it is not listed here

    def __post_init__(self) -> None:
        for name in (
            "num_experts",
            "num_experts_per_tok",
            "expert_intermediate_size",
            "decoder_sparse_step",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must not exceed the "
                f"number of experts ({self.num_experts})"
            )
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        for layer in self.mlp_only_layers:
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ValueError(
                    f"mlp_only_layers must list layer numbers, got {list(self.mlp_only_layers)}"
                )

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (the model's numbering) routes through experts."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def parse_moe(raw: Mapping[str, Any], architecture: str) -> MoeConfig | None:
    """The MoE description of a `config.json` of `architecture` (None for a dense one)."""
    if architecture not in MOE_ARCHITECTURES:
        return None
    for name in _UNSUPPORTED_FIELDS:
        if raw.get(name):
            raise ValueError(
                f"{architecture} with {name}={raw[name]!r} is not supported (Tandem's "
                f"experts are routed only: no shared or grouped experts)"
            )
    if architecture == "mixtral":
        return MoeConfig(
            num_experts=_required(raw, "num_local_experts"),
            num_experts_per_tok=_required(raw, "num_experts_per_tok"),
            expert_intermediate_size=_required(raw, "intermediate_size"),
            norm_topk_prob=True,  # Mixtral always renormalises
        )
    layers = raw.get("mlp_only_layers") or []
    if not isinstance(layers, list | tuple):
        raise ValueError(f"mlp_only_layers must be a list of layer numbers, got {layers!r}")
    step, norm = raw.get("decoder_sparse_step"), raw.get("norm_topk_prob")
    return MoeConfig(  # absent or null: Qwen3MoeConfig's defaults
        num_experts=_qwen3_moe_experts(raw),
        num_experts_per_tok=_required(raw, "num_experts_per_tok"),
        expert_intermediate_size=_required(raw, "moe_intermediate_size"),
        norm_topk_prob=False if norm is None else norm,
        decoder_sparse_step=1 if step is None else step,
        mlp_only_layers=tuple(layers),
    )


def _qwen3_moe_experts(raw: Mapping[str, Any]) -> int:
    """Qwen3MoeConfig's `num_experts`, which `save_pretrained` writes as `num_local_experts`
    (its attribute map): either name, and both only when they agree."""
    named = {k: raw[k] for k in ("num_experts", "num_local_experts") if raw.get(k) is not None}
    if not named:
        raise ValueError("config.json is missing required field 'num_experts'")
    if len(set(map(repr, named.values()))) > 1:
        raise ValueError(
            f"config.json gives num_experts={named['num_experts']!r} and "
            f"num_local_experts={named['num_local_experts']!r}; they must agree"
        )
    return _checked_int(next(iter(named.items())))


def _required(raw: Mapping[str, Any], key: str) -> int:
    if raw.get(key) is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return _checked_int((key, raw[key]))


def _checked_int(item: tuple[str, Any]) -> int:
    key, value = item
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json field {key!r} must be a positive integer, got {value!r}")
    return value
