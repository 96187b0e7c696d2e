"""RoPE settings of a Hugging Face config: parsing and validation of `rope_scaling` /
`rope_parameters`, and how each type's rotation depends on sequence length.

Types: default, linear, llama3, yarn (static: a token's rotation depends on its position
only) and dynamic, longrope (length-dependent: in transformers the frequencies follow the
length of each forward call, so a token's rotation depends on max(prompt length, its
position + 1); see `services/worker/models/rope.py`). The prefix cache keys blocks on
`prompt_rope_key`, the part of that state a prompt's KV depends on. Pure Python (no torch):
the gateway and scheduler use it too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
DEFAULT_ROPE_THETA = 10_000.0
# Numeric keys each type needs; lists (longrope's factors) are checked on their own.
_REQUIRED_NUMBERS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("original_max_position_embeddings",),
}
# Optional keys kept (None: transformers' default); anything else in the config is ignored.
_OPTIONAL = {
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("factor", "attention_factor", "short_factor", "long_factor"),
}
# Types whose `original_max_position_embeddings` transformers fills in (a top-level field of
# that name wins over the one in the rope parameters, else max_position_embeddings).
_ORIGINAL_MAX_TYPES = ("llama3", "yarn", "longrope")

Scaling = tuple[tuple[str, object], ...]


def parse_rope(raw: Mapping[str, Any], max_positions: int) -> tuple[float, Scaling | None]:
    """(rope_theta, sorted scaling items or None) from either config layout (transformers
    v5 `rope_parameters` or v4 `rope_theta` + `rope_scaling`). Lists become tuples, so the
    result is hashable."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope parameters must be a JSON object, got {params!r}")
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ValueError("per-layer-type rope parameters are not supported")
    params = dict(params)
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = raw.get("rope_theta", DEFAULT_ROPE_THETA)
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise ValueError(f"rope_theta must be a number, got {theta!r}")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    if rope_type in _ORIGINAL_MAX_TYPES:
        top_level = raw.get("original_max_position_embeddings")
        if top_level is not None:  # transformers' standardize_rope_params gives it priority
            params["original_max_position_embeddings"] = top_level
        params.setdefault("original_max_position_embeddings", max_positions)
    original = params.get("original_max_position_embeddings")
    implicit = rope_type == "longrope" or (rope_type == "yarn" and "factor" in params)
    if implicit and params.get("factor") is None and _number(original) and original > 0:
        params["factor"] = max_positions / original  # transformers' implicit factor
    keys = (*_REQUIRED_NUMBERS[rope_type], *_OPTIONAL.get(rope_type, ()))
    scaling = {"rope_type": rope_type}
    for key in keys:
        value = params.get(key)
        if value is not None:
            scaling[key] = tuple(value) if isinstance(value, list) else value
    validate_rope_scaling(scaling)
    return float(theta), tuple(sorted(scaling.items()))


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def validate_rope_scaling(scaling: Mapping[str, object], head_dim: int | None = None) -> None:
    """Raise ValueError (one line naming the type and the field) unless `scaling` is a
    complete, valid setting of a supported non-default type. `head_dim`: also check the
    length of longrope's factor lists."""
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES or rope_type == "default":
        raise ValueError(
            f"unsupported rope type {rope_type!r} in rope_scaling; "
            f"supported: {', '.join(t for t in SUPPORTED_ROPE_TYPES if t != 'default')}"
        )
    for key in _REQUIRED_NUMBERS[str(rope_type)]:
        value = scaling.get(key)
        if not _number(value):
            raise ValueError(f"{rope_type} rope scaling needs a numeric {key!r}, got {value!r}")
        if value <= 0:
            raise ValueError(f"{rope_type} rope scaling {key!r} must be positive, got {value!r}")
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
    if rope_type == "yarn":
        _check_optional(scaling, "yarn", ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"))
        if "truncate" in scaling and not isinstance(scaling["truncate"], bool):
            value = scaling["truncate"]
            raise ValueError(f"yarn rope scaling 'truncate' must be a boolean, got {value!r}")
    if rope_type in ("yarn", "longrope"):
        _check_optional(scaling, str(rope_type), ("factor", "attention_factor"), positive=True)
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            value = scaling.get(key)
            if not isinstance(value, list | tuple) or not value or not all(map(_number, value)):
                raise ValueError(f"longrope rope scaling needs a list of numbers {key!r}")
            if head_dim is not None and len(value) != head_dim // 2:
                raise ValueError(
                    f"longrope rope scaling {key!r} has {len(value)} entries, "
                    f"head_dim {head_dim} needs {head_dim // 2}"
                )


def _check_optional(
    scaling: Mapping[str, object], rope_type: str, keys: tuple[str, ...], positive: bool = False
) -> None:
    for key in keys:
        value = scaling.get(key)
        if value is None:
            continue
        if not _number(value) or (positive and value <= 0):
            kind = "a positive number" if positive else "a number"
            raise ValueError(f"{rope_type} rope scaling {key!r} must be {kind}, got {value!r}")


def max_context_length(config: Any) -> int:
    """The longest sequence the model's RoPE serves (`config`: a ModelConfig)."""
    scaling = None if config.rope_scaling is None else dict(config.rope_scaling)
    return scaled_max_positions(scaling, config.max_position_embeddings)


def scaled_max_positions(scaling: Mapping[str, object] | None, max_positions: int) -> int:
    """max_position_embeddings, times `factor` for dynamic scaling (whose point is to run
    past it; vLLM derives the same); every other type as it is (yarn, llama3 and longrope
    configs give their extended length there)."""
    if scaling is not None and scaling.get("rope_type") == "dynamic":
        return max(max_positions, int(max_positions * scaling["factor"]))
    return max_positions


def rope_length_threshold(config: Any) -> int:
    """Longest sequence whose rotations do not depend on its length (`config`: a
    ModelConfig); 0 for static types. dynamic: max_position_embeddings; longrope: its
    original_max_position_embeddings (rounded down: lengths are integers)."""
    if config.rope_type == "dynamic":
        return config.max_position_embeddings
    if config.rope_type == "longrope":
        return math.floor(dict(config.rope_scaling)["original_max_position_embeddings"])
    return 0


def prompt_rope_key(rope_type: str, threshold: int, prompt_len: int) -> str:
    """The RoPE state a prompt's KV is computed under, for the prefix cache's hashes: ""
    wherever KV does not depend on the prompt's length (static types, prompts up to the
    threshold). Past it: dynamic rotates every prompt token with frequencies of the
    prompt's length, longrope with its long factors.

    Safe for tokens generated after the prompt too (they are rotated by position + 1
    instead): that state only grows with the length, so a prompt with the same key as the
    one that generated a cached block has every token of that block in the same state."""
    if rope_type not in LENGTH_DEPENDENT_ROPE_TYPES or not threshold or prompt_len <= threshold:
        return ""
    return f"dynamic:{prompt_len}" if rope_type == "dynamic" else "longrope:long"
