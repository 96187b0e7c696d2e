"""Gemma 2 / Gemma 3 text config parsing (`common.gemma_config`, through `ModelConfig`) against
what transformers' own config classes make of the same fields: layer types and windows, each
layer type's RoPE (v5 `rope_parameters` per layer type, v4 `rope_theta` /
`rope_local_base_freq` / `rope_scaling`), the config classes' defaults; and the refusals of
what Tandem does not compute, each one line naming the field.
"""

from __future__ import annotations

import pytest
import transformers

from common.gemma_config import GemmaConfig
from common.model_config import ModelConfig

SHAPE = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
}
HF_CLASSES = {"gemma2": transformers.Gemma2Config, "gemma3_text": transformers.Gemma3TextConfig}


def ours(architecture: str, **fields) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": architecture, **SHAPE, **fields})


def hf(architecture: str, **fields):
    return HF_CLASSES[architecture](**SHAPE, **fields)


def _rope(theta: float, scaling) -> dict:
    return {"rope_theta": theta, **dict(scaling or {"rope_type": "default"})}


def assert_same_as_hf(architecture: str, **fields) -> ModelConfig:
    """Our parse of `fields` against the HF config class's, layer by layer."""
    config, reference = ours(architecture, **fields), hf(architecture, **fields)
    layer_types = reference.layer_types
    for layer, layer_type in enumerate(layer_types):
        window = reference.sliding_window if layer_type == "sliding_attention" else None
        assert config.sliding_window(layer) == window, (layer, layer_type)
        assert config.gemma.sliding_layers[layer] == (layer_type == "sliding_attention")
    gemma = config.gemma
    if architecture == "gemma3_text":
        full, local = (
            reference.rope_parameters[t] for t in ("full_attention", "sliding_attention")
        )
        assert _rope(config.rope_theta, config.rope_scaling) == full
        assert _rope(gemma.local_rope_theta, gemma.local_rope_scaling) == local
        assert gemma.attn_logit_softcapping is None  # never applied by HF's Gemma 3
    else:
        assert config.rope_theta == reference.rope_parameters["rope_theta"]
        assert gemma.local_rope_theta is None
        assert gemma.attn_logit_softcapping == reference.attn_logit_softcapping
    assert gemma.final_logit_softcapping == reference.final_logit_softcapping
    assert gemma.query_pre_attn_scalar == reference.query_pre_attn_scalar
    assert config.head_dim == reference.head_dim
    assert config.tie_word_embeddings == reference.tie_word_embeddings
    assert config.rms_norm_eps == reference.rms_norm_eps
    assert config.qk_norm == (architecture == "gemma3_text")
    return config


@pytest.mark.parametrize(
    "fields",
    [
        {"num_hidden_layers": 5},  # every other layer sliding, from layer 0
        {"num_hidden_layers": 3, "sliding_window": 6, "layer_types": ["full_attention"] * 3},
        {
            "num_hidden_layers": 4,
            "sliding_window": 7,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": 5.0,
            "query_pre_attn_scalar": 32,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        },
        {"num_hidden_layers": 2, "rope_theta": 1234.0},  # v4
    ],
)
def test_gemma2_reads_what_transformers_reads(fields) -> None:
    assert_same_as_hf("gemma2", **fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"num_hidden_layers": 13},  # sliding_window_pattern 6: layers 5 and 11 full
        {"num_hidden_layers": 4, "sliding_window_pattern": 2, "sliding_window": 9},
        {  # v4 (the Hub's Gemma 3): thetas apart, scaling on the full layers
            "num_hidden_layers": 6,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
        },
        {  # v5, as transformers writes it
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 2e4},
            },
        },
        {  # v5 with one layer type left out: the defaults fill it in
            "num_hidden_layers": 2,
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 7.0}},
        },
    ],
)
def test_gemma3_reads_what_transformers_reads(fields) -> None:
    assert_same_as_hf("gemma3_text", **fields)


def test_transformers_written_config_round_trips() -> None:
    """A config dict as `save_pretrained` writes it parses as the HF class reads it back."""
    for architecture in HF_CLASSES:
        written = hf(architecture, num_hidden_layers=7, sliding_window=5).to_dict()
        config = ModelConfig.from_dict(written)
        assert config.architecture == architecture and config.num_hidden_layers == 7
        assert config.layer_windows == tuple(
            5 if t == "sliding_attention" else None for t in written["layer_types"]
        )


def test_defaults_of_the_config_classes() -> None:
    """Fields config.json leaves out take the config class's defaults, as in transformers."""
    shape = {k: v for k, v in SHAPE.items() if k not in ("head_dim", "max_position_embeddings")}
    for architecture in HF_CLASSES:
        config = ModelConfig.from_dict(
            {"model_type": architecture, **shape, "num_hidden_layers": 2}
        )
        reference = HF_CLASSES[architecture](**shape, num_hidden_layers=2)
        assert config.head_dim == reference.head_dim == 256
        assert config.max_position_embeddings == reference.max_position_embeddings
        assert config.tie_word_embeddings and config.eos_token_ids == (1,)
        assert config.gemma.attention_scale == 256**-0.5
    assert ours("gemma2", num_hidden_layers=1).gemma.final_logit_softcapping == 30.0
    assert ours("gemma3_text", num_hidden_layers=1).gemma.final_logit_softcapping is None


@pytest.mark.parametrize(
    "architecture, fields, message",
    [
        ("gemma2", {"hidden_activation": "gelu"}, "gemma2 with hidden_activation='gelu'"),
        (
            "gemma3_text",
            {"use_bidirectional_attention": True},
            "gemma3_text with use_bidirectional_attention=true is not supported",
        ),
        (
            "gemma3_text",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            "gemma3_text rope_parameters must be given per layer type",
        ),
        (
            "gemma3_text",
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "gemma3_text full_attention rope type 'dynamic' is not supported",
        ),
        ("gemma2", {"final_logit_softcapping": 0}, "final_logit_softcapping must be"),
        ("gemma2", {"query_pre_attn_scalar": None}, "query_pre_attn_scalar must be"),
        ("gemma3_text", {"sliding_window_pattern": 0}, "sliding_window_pattern must be"),
        ("gemma2", {"layer_types": ["sliding_attention"]}, "layer_types must list one type"),
        ("gemma3", {}, "unsupported model_type 'gemma3'"),  # the multimodal checkpoint
    ],
)
def test_unsupported_fields_are_refused_naming_them(architecture, fields, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ours(architecture, num_hidden_layers=2, **fields)


def test_gemma_config_validates() -> None:
    with pytest.raises(ValueError, match="attn_logit_softcapping must be a positive number"):
        GemmaConfig(
            query_pre_attn_scalar=256, attn_logit_softcapping=-1.0, final_logit_softcapping=None
        )
    assert ours("llama", num_hidden_layers=1).gemma is None
