"""Which decoder layers attend through a sliding window, and how wide it is, read from a
Hugging Face `config.json` exactly as transformers v5 reads it.

- mistral, mixtral: `sliding_window` (when set) windows every layer (their modeling code
  ignores `layer_types`);
- qwen3_moe: `sliding_window` windows every layer when `use_sliding_window` is true;
- qwen2, qwen3: with `use_sliding_window`, `layer_types` names each layer
  ("sliding_attention" / "full_attention"); without it, layers `i >= max_window_layers` are
  windowed;
- gemma2, gemma3_text: `layer_types` names each layer; without it, Gemma 2 windows every
  other layer from layer 0 and Gemma 3 all but every `sliding_window_pattern`-th (default 6;
  `gemma_layer_types`);
- gpt_oss: `layer_types` names each layer; without it, every other layer from layer 0 is
  windowed (as Gemma 2);
- llama: never windowed.

A window of W (HF's `sliding_window`) lets the query at position p see keys at positions
k with p - W < k <= p: W positions, its own included (`masking_utils.sliding_window_overlay`).
Pure Python, like `common.model_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"


def parse_layer_windows(raw: Mapping[str, Any], architecture: str) -> tuple[int | None, ...] | None:
    """Each layer's window (None: full attention), or None when no layer is windowed."""
    num_layers = raw.get("num_hidden_layers")
    window = raw.get("sliding_window")
    if not isinstance(num_layers, int) or window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    if architecture in ("mistral", "mixtral"):
        windows: list[int | None] = [window] * num_layers
    elif architecture == "qwen3_moe":
        windows = [window if raw.get("use_sliding_window") else None] * num_layers
    elif architecture in ("qwen2", "qwen3"):
        if not raw.get("use_sliding_window"):
            return None
        windows = _qwen_layer_windows(raw, window, num_layers)
    elif architecture in ("gemma2", "gemma3_text", "gpt_oss"):
        layer_types = gemma_layer_types(raw, architecture, num_layers)
        windows = [window if t == SLIDING else None for t in layer_types]
    else:
        return None
    return tuple(windows) if any(w is not None for w in windows) else None


def gemma_layer_types(raw: Mapping[str, Any], architecture: str, num_layers: Any) -> list[str]:
    """Each layer's type as `Gemma2Config` / `Gemma3TextConfig` (and `GptOssConfig`) set it:
    `layer_types`, else Gemma 2's (and gpt-oss's) sliding layers 0, 2, 4, ... and Gemma 3's
    every layer but each `sliding_window_pattern`-th."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"num_hidden_layers must be a positive integer, got {num_layers!r}")
    if raw.get("layer_types") is not None:
        return _checked_layer_types(raw["layer_types"], num_layers)
    pattern = 2 if architecture in ("gemma2", "gpt_oss") else raw.get("sliding_window_pattern", 6)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise ValueError(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


def _qwen_layer_windows(raw: Mapping[str, Any], window: int, num_layers: int) -> list[int | None]:
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = raw.get("max_window_layers", 28)  # Qwen2Config's / Qwen3Config's default
        return [window if i >= first else None for i in range(num_layers)]
    return [window if t == SLIDING else None for t in _checked_layer_types(layer_types, num_layers)]


def _checked_layer_types(layer_types: Any, num_layers: int) -> list[str]:
    if not isinstance(layer_types, list | tuple) or len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types must list one type per layer ({num_layers}), got {layer_types!r}"
        )
    unknown = sorted({t for t in layer_types if t not in (SLIDING, FULL)})
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}; supported: {SLIDING}, {FULL}")
    return list(layer_types)
