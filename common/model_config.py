"""The model architecture description every service agrees on, parsed from a checkpoint folder.

`ModelConfig` is a frozen, validated view of a Hugging Face `config.json` (plus the optional
`generation_config.json`) restricted to what Tandem's model code supports: decoder-only
llama-family models (llama, mistral, qwen2, qwen3) and their mixture-of-experts relatives
(mixtral: mistral's attention; qwen3_moe: qwen3's; experts described by
`common.moe_config.MoeConfig`) with default, linear, llama3, yarn, dynamic or longrope
RoPE (`common.rope_config`), Gemma 2 / Gemma 3 text (gemma2, gemma3_text: their own
norms, scales, soft-caps and local RoPE in `common.gemma_config.GemmaConfig`), and
DeepSeek-V2 / V3 (deepseek_v2, deepseek_v3: latent attention, `common.mla_config.MlaConfig`,
whose KV cache geometry `num_key_value_heads` / `head_dim` describe; DeepSeek's experts).
OpenAI's gpt-oss (gpt_oss: attention sinks, biased experts with a clamped SwiGLU,
`common.gpt_oss_config`) too.
Anything outside that is rejected here with a `ValueError`, before any weights are read.
Both the transformers-v5 layout (`rope_parameters`) and the legacy v4 layout (`rope_theta` +
`rope_scaling`) are accepted. Pure Python: no torch import, so the gateway and scheduler can
use it too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.gemma_config import (
    GEMMA_ARCHITECTURES,
    GemmaConfig,
    global_rope_raw,
    parse_gemma,
    with_defaults,
)
from common.gpt_oss_config import (
    GPT_OSS,
    GptOssConfig,
    gpt_oss_defaults,
    gpt_oss_moe,
    parse_gpt_oss,
)
from common.kv_groups import KvGroups, kv_groups
from common.mla_config import MlaConfig, parse_mla
from common.moe_config import MoeConfig, parse_moe
from common.rope_config import parse_rope, validate_rope_scaling
from common.sliding_window import parse_layer_windows

SUPPORTED_ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma2", "gemma3_text",
    "gpt_oss",
    "deepseek_v2", "deepseek_v3",
)  # fmt: skip
_QWEN3_DEFAULT_HEAD_DIM = 128  # Qwen3Config's own default when config.json has no head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of one supported checkpoint."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, object], ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str = "float32"
    moe: MoeConfig | None = None  # routed experts (mixtral, qwen3_moe); None: dense
    # Each layer's sliding window (`common.sliding_window`); None: every layer attends fully.
    layer_windows: tuple[int | None, ...] | None = None
    gemma: GemmaConfig | None = None  # gemma2, gemma3_text; None: llama family
    gpt_oss: GptOssConfig | None = None  # gpt_oss's clamped SwiGLU; None: other families
    # Latent attention (deepseek_v2, deepseek_v3); None: every head has its own K/V. With
    # it, num_key_value_heads (1) and head_dim (latent_dim / 2) are the KV cache's geometry.
    mla: MlaConfig | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for field_name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field_name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0 and self.mla is None:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (isinstance(self.rms_norm_eps, int | float) and self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, int | float) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            validate_rope_scaling(dict(self.rope_scaling), self.rope_head_dim)
        for token_id in self.eos_token_ids:
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(
                    f"eos_token_ids must be non-negative ints, got {self.eos_token_ids}"
                )
        if self.bos_token_id is not None and self.bos_token_id < 0:
            raise ValueError(f"bos_token_id must be non-negative, got {self.bos_token_id}")

    @property
    def rope_type(self) -> str:
        """'default' or the scaling type (`common.rope_config.SUPPORTED_ROPE_TYPES`)."""
        if self.rope_scaling is None:
            return "default"
        return str(dict(self.rope_scaling)["rope_type"])

    @property
    def rope_head_dim(self) -> int:
        """The rotated size: every head's (MLA: its `qk_rope_head_dim` part)."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def sliding_window(self, layer: int) -> int | None:
        """Decoder layer `layer`'s window W (a query sees its own and the W - 1 previous
        positions), or None for full attention."""
        return None if self.layer_windows is None else self.layer_windows[layer]

    def kv_groups(self, hybrid: bool = True) -> KvGroups:
        """Which layers share a block table (`common.kv_groups`); `hybrid=False`: one."""
        return kv_groups(self.layer_windows, self.num_hidden_layers, hybrid)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has routed experts instead of a dense MLP."""
        return self.moe is not None and self.moe.is_sparse_layer(layer)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> ModelConfig:
        """Read `config.json` (required) and `generation_config.json` (optional) from `folder`."""
        path = Path(folder)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ValueError(f"no config.json in model folder {str(path)!r}")
        raw = _read_json(config_path)
        generation_path = path / "generation_config.json"
        generation = _read_json(generation_path) if generation_path.is_file() else None
        return cls.from_dict(raw, name=path.resolve().name, generation_config=generation)

    @classmethod
    def from_dict(
        cls,
        raw: Mapping[str, Any],
        name: str = "model",
        generation_config: Mapping[str, Any] | None = None,
    ) -> ModelConfig:
        """Build from the parsed contents of `config.json` (and `generation_config.json`)."""
        architecture = raw.get("model_type")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if architecture in GEMMA_ARCHITECTURES:
            raw = with_defaults(raw, architecture)  # the config classes' defaults
        if architecture == GPT_OSS:
            raw = gpt_oss_defaults(raw)  # GptOssConfig's
        _reject_unsupported_features(raw, architecture)

        hidden_size = _required_int(raw, "hidden_size")
        num_heads = _required_int(raw, "num_attention_heads")
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        max_positions = _required_int(raw, "max_position_embeddings")
        head_dim = raw.get("head_dim")
        rope_theta, rope_scaling = parse_rope(global_rope_raw(raw, architecture), max_positions)
        mla = parse_mla(raw, architecture, None if rope_scaling is None else dict(rope_scaling))
        if mla is not None:  # one latent "head" split over the cache's K and V halves
            num_kv_heads, head_dim = 1, mla.latent_dim // 2
        elif head_dim is None:
            if architecture == "qwen3":  # (Qwen3MoeConfig has no such default)
                head_dim = _QWEN3_DEFAULT_HEAD_DIM
            elif hidden_size % num_heads != 0:
                raise ValueError(
                    f"hidden_size ({hidden_size}) is not a multiple of num_attention_heads "
                    f"({num_heads}) and config.json gives no head_dim"
                )
            else:
                head_dim = hidden_size // num_heads

        generation = generation_config or {}
        eos = generation.get("eos_token_id")
        if eos is None:
            eos = raw.get("eos_token_id")
        bos = generation.get("bos_token_id")
        if bos is None:
            bos = raw.get("bos_token_id")

        return cls(
            name=name,
            architecture=architecture,
            vocab_size=_required_int(raw, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_required_int(raw, "intermediate_size"),
            num_hidden_layers=_required_int(raw, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(raw, architecture),
            qk_norm=architecture in ("qwen3", "qwen3_moe", "gemma3_text"),
            eos_token_ids=_token_ids(eos),
            bos_token_id=bos if bos is None else int(bos),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            moe=gpt_oss_moe(raw) if architecture == GPT_OSS else parse_moe(raw, architecture),
            layer_windows=parse_layer_windows(raw, architecture),
            gemma=parse_gemma(raw, architecture),
            gpt_oss=parse_gpt_oss(raw, architecture),
            mla=mla,
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _required_int(raw: Mapping[str, Any], key: str) -> int:
    if key not in raw or raw[key] is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config.json field {key!r} must be an integer, got {value!r}")
    return value


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, bool):
        raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(dict.fromkeys(value))
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _attention_bias(raw: Mapping[str, Any], architecture: str) -> bool:
    """qwen2 always biases q/k/v; mistral and mixtral never bias; llama, qwen3, qwen3_moe and
    the Gemmas follow `attention_bias`."""
    if architecture == "qwen2":
        return True
    if architecture in ("mistral", "mixtral"):
        return False
    return bool(raw.get("attention_bias", False))


def _reject_unsupported_features(raw: Mapping[str, Any], architecture: str) -> None:
    act = raw.get("hidden_act", "silu")  # (Gemma's is hidden_activation: common.gemma_config)
    if act != "silu" and architecture not in GEMMA_ARCHITECTURES:
        raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is supported")
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
