"""The mixture-of-experts part of a checkpoint's architecture (Mixtral, Qwen3-MoE, DeepSeek-V2
/ V3), parsed and validated from its `config.json`.

`MoeConfig` says how many routed experts each sparse layer has, how many of them a token
goes through, their inner size, whether the top-k routing weights are renormalised, and
which decoder layers are sparse (Qwen3-MoE's `decoder_sparse_step` and `mlp_only_layers`:
the others keep a dense MLP of `intermediate_size`; Mixtral's layers are all sparse).
DeepSeek's routing (`parse_deepseek_moe`, as transformers v5 computes it): router logits in
float32; V3 scores them with a sigmoid, adds `e_score_correction_bias` for the choice only,
keeps the `topk_group` best of `n_group` expert groups (a group's score: its two best
experts' sum), renormalises the chosen scores (`norm_topk_prob`); V2 scores with a softmax,
`greedy` or `group_limited_greedy` (a group's score: its best expert's), never
renormalised; both scale the weights by `routed_scaling_factor` and add `n_shared_experts`
always-on experts (one MLP of `n_shared_experts * moe_intermediate_size`); the first
`first_k_dense_replace` layers are dense. Whatever Tandem's expert computation does not
implement (shared experts as in qwen2_moe, grouped routing outside DeepSeek, a top-k larger
than the expert count, missing sizes) is a `ValueError` naming the field, before any
weight is read. Pure Python, like
`common.model_config`, which holds one of these as `ModelConfig.moe`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")
DEEPSEEK_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
# MoeConfig.routing: softmax top-k (Mixtral, Qwen3-MoE, DeepSeek-V2 greedy), DeepSeek-V2's
# group-limited softmax, DeepSeek-V3's biased sigmoid over groups.
SOFTMAX, SOFTMAX_GROUPS, SIGMOID_GROUPS = "softmax", "softmax_groups", "sigmoid_groups"
_V2_TOPK_METHODS = {"greedy": SOFTMAX, "group_limited_greedy": SOFTMAX_GROUPS}
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
    # DeepSeek (see the module docstring); the defaults are the plain softmax router's.
    routing: str = SOFTMAX
    n_group: int = 1  # expert groups (SOFTMAX_GROUPS, SIGMOID_GROUPS) ...
    topk_group: int = 1  # ... of which a token's experts come from the best topk_group
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # the shared experts' MLP; 0: none

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

        if self.routing not in (SOFTMAX, SOFTMAX_GROUPS, SIGMOID_GROUPS):
            raise ValueError(f"unknown MoE routing {self.routing!r}")
        if self.routing != SOFTMAX:
            _check_groups(self)

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (the model's numbering) routes through experts."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def parse_moe(raw: Mapping[str, Any], architecture: str) -> MoeConfig | None:
    """The MoE description of a `config.json` of `architecture` (None for a dense one)."""
    if architecture in DEEPSEEK_ARCHITECTURES:
        return parse_deepseek_moe(raw, architecture)
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


def parse_deepseek_moe(raw: Mapping[str, Any], architecture: str) -> MoeConfig | None:
    """DeepSeek-V2 / V3's experts (None: every layer dense, `first_k_dense_replace` >= the
    layer count). Absent fields take the config classes' defaults."""
    v3 = architecture == "deepseek_v3"
    layers = raw.get("num_hidden_layers")
    dense = raw.get("first_k_dense_replace", 3 if v3 else 0)
    dense = 0 if dense is None else _nonnegative("first_k_dense_replace", dense)
    if isinstance(layers, int) and dense >= layers:
        return None
    freq = raw.get("moe_layer_freq", 1)
    if freq not in (None, 1):
        raise ValueError(f"{architecture} with moe_layer_freq={freq!r} is not supported (only 1)")
    if v3:
        routing = SIGMOID_GROUPS  # transformers' DeepseekV3TopkRouter ignores topk_method
        norm = raw.get("norm_topk_prob", True)
    else:
        method = raw.get("topk_method", "greedy")
        if method not in _V2_TOPK_METHODS:
            raise ValueError(
                f"deepseek_v2 with topk_method={method!r} is not supported "
                f"(greedy, group_limited_greedy)"
            )
        routing, norm = _V2_TOPK_METHODS[method], False  # (V2's router never renormalises)
    inner = _required(raw, "moe_intermediate_size")
    shared = raw.get("n_shared_experts", 1 if v3 else 2)
    shared = 0 if shared is None else _nonnegative("n_shared_experts", shared)
    scaling = raw.get("routed_scaling_factor", 2.5 if v3 else 1.0)
    if isinstance(scaling, bool) or not isinstance(scaling, int | float) or scaling <= 0:
        raise ValueError(f"routed_scaling_factor must be a positive number, got {scaling!r}")
    groups = {"n_group": 8 if v3 else None, "topk_group": 4 if v3 else None}
    groups = {k: raw.get(k, default) for k, default in groups.items()}
    if routing == SOFTMAX:
        groups = {"n_group": 1, "topk_group": 1}
    for key, value in groups.items():
        if value is None:
            raise ValueError(f"{architecture} with topk_method grouping needs {key}")
    return MoeConfig(
        num_experts=_required(raw, "n_routed_experts"),
        num_experts_per_tok=_required(raw, "num_experts_per_tok"),
        expert_intermediate_size=inner,
        norm_topk_prob=bool(norm),
        mlp_only_layers=tuple(range(dense)),
        routing=routing,
        n_group=groups["n_group"],
        topk_group=groups["topk_group"],
        routed_scaling_factor=float(scaling),
        shared_intermediate_size=inner * shared,
    )


def _check_groups(moe: MoeConfig) -> None:
    """Grouped routing as transformers can compute it: groups of equal size (V3 scores a
    group by its two best experts), `topk_group` of them, holding at least top-k experts."""
    for name in ("n_group", "topk_group"):
        value = getattr(moe, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if moe.num_experts % moe.n_group:
        raise ValueError(
            f"n_group ({moe.n_group}) must divide the number of experts ({moe.num_experts})"
        )
    per_group = moe.num_experts // moe.n_group
    if moe.topk_group > moe.n_group:
        raise ValueError(f"topk_group ({moe.topk_group}) must not exceed n_group ({moe.n_group})")
    if moe.routing == SIGMOID_GROUPS and per_group < 2:
        raise ValueError(
            f"n_group ({moe.n_group}) leaves {per_group} expert per group; DeepSeek-V3 scores "
            f"a group by its two best experts"
        )
    if moe.topk_group * per_group < moe.num_experts_per_tok:
        raise ValueError(
            f"topk_group ({moe.topk_group}) groups of {per_group} experts cannot hold "
            f"num_experts_per_tok ({moe.num_experts_per_tok})"
        )


def _nonnegative(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config.json field {key!r} must be a non-negative integer, got {value!r}")
    return value


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
