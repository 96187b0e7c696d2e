"""ModelConfig parsing of HF config.json / generation_config.json in both v4 and v5 layouts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from common.model_config import ModelConfig


def base(**overrides) -> dict:
    raw = {
        "model_type": "llama",
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    raw.update(overrides)
    return raw


def test_v5_rope_parameters_default() -> None:
    config = ModelConfig.from_dict(
        base(rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, dtype="bfloat16"),
        name="m",
    )
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is None and config.rope_type == "default"
    assert config.head_dim == 16 and config.num_queries_per_kv == 2
    assert config.torch_dtype == "bfloat16"
    assert config.name == "m" and config.architecture == "llama"
    assert config.eos_token_ids == (1,) and config.bos_token_id == 0


def test_v4_rope_theta_and_defaults() -> None:
    raw = base(rope_theta=1e6, rope_scaling=None, torch_dtype="float16")
    del raw["num_key_value_heads"]
    config = ModelConfig.from_dict(raw)
    assert config.rope_theta == 1e6 and config.rope_scaling is None
    assert config.num_key_value_heads == 4
    assert config.torch_dtype == "float16"
    assert not config.tie_word_embeddings and not config.attention_bias and not config.qk_norm


def test_missing_rope_and_dtype_fall_back_to_defaults() -> None:
    config = ModelConfig.from_dict(base())
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert config.torch_dtype == "float32"


LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "raw",
    [
        base(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}),
        base(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3}),
        base(rope_theta=500000.0, rope_scaling={"type": "llama3", **LLAMA3}),
    ],
    ids=["v5", "v4-rope_type", "v4-type"],
)
def test_llama3_scaling_parsed_from_every_layout(raw: dict) -> None:
    config = ModelConfig.from_dict(raw)
    assert config.rope_theta == 500000.0
    assert config.rope_type == "llama3"
    assert config.rope_scaling == tuple(sorted({"rope_type": "llama3", **LLAMA3}.items()))
    hash(config)  # frozen and hashable, scaling included


def test_llama3_original_max_defaults_to_max_positions() -> None:
    scaling = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    config = ModelConfig.from_dict(base(rope_scaling={"rope_type": "llama3", **scaling}))
    assert dict(config.rope_scaling)["original_max_position_embeddings"] == 512


def test_linear_scaling() -> None:
    config = ModelConfig.from_dict(
        base(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    )
    assert config.rope_scaling == (("factor", 4.0), ("rope_type", "linear"))


@pytest.mark.parametrize("rope_type", ["su", "proportional", "deepseek_yarn"])
def test_unsupported_rope_type_rejected(rope_type: str) -> None:
    raw = base(rope_parameters={"rope_type": rope_type, "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match=f"unsupported rope type '{rope_type}'"):
        ModelConfig.from_dict(raw)


def test_incomplete_scaling_rejected() -> None:
    with pytest.raises(ValueError, match="factor"):
        ModelConfig.from_dict(base(rope_scaling={"type": "linear"}))
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_dict(base(partial_rotary_factor=0.5))


def test_unsupported_architecture_lists_supported() -> None:
    with pytest.raises(ValueError, match="'gpt2'.*llama, mistral, qwen2, qwen3"):
        ModelConfig.from_dict(base(model_type="gpt2"))


def test_mistral_sliding_window() -> None:
    """mistral's `sliding_window` windows every layer (transformers ignores `layer_types`)."""
    windowed = ModelConfig.from_dict(base(model_type="mistral", sliding_window=128))
    layers = windowed.num_hidden_layers
    assert windowed.layer_windows == (128,) * layers
    assert [windowed.sliding_window(i) for i in range(layers)] == [128] * layers
    full = ModelConfig.from_dict(base(model_type="mistral", sliding_window=None))
    assert full.architecture == "mistral" and not full.attention_bias
    assert full.layer_windows is None and full.sliding_window(0) is None
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        ModelConfig.from_dict(base(model_type="mistral", sliding_window=-1))


def test_qwen_flavours() -> None:
    qwen2 = ModelConfig.from_dict(
        base(model_type="qwen2", use_sliding_window=False, sliding_window=None)
    )
    assert qwen2.attention_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_dict(base(model_type="qwen3", head_dim=32))
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 32
    raw = base(model_type="qwen3")
    assert ModelConfig.from_dict(raw).head_dim == 128  # Qwen3Config's default, not hidden/heads
    assert qwen2.layer_windows is None


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_qwen_sliding_window_layers(architecture: str) -> None:
    """As Qwen2Config/Qwen3Config: with `use_sliding_window`, layers i >= max_window_layers
    are windowed, unless `layer_types` names each layer; without it, none."""
    raw = base(model_type=architecture, use_sliding_window=True, sliding_window=64)
    layers = raw["num_hidden_layers"]
    windows = ModelConfig.from_dict({**raw, "max_window_layers": 1}).layer_windows
    assert windows == (None,) + (64,) * (layers - 1)
    assert ModelConfig.from_dict({**raw, "max_window_layers": layers}).layer_windows is None
    types = ["sliding_attention", "full_attention"] * (layers // 2) + ["full_attention"] * (
        layers % 2
    )
    explicit = ModelConfig.from_dict({**raw, "layer_types": types}).layer_windows
    assert explicit == tuple(64 if t == "sliding_attention" else None for t in types)
    off = {**raw, "use_sliding_window": False, "max_window_layers": 0}
    assert ModelConfig.from_dict(off).layer_windows is None
    with pytest.raises(ValueError, match="unsupported layer_types"):
        ModelConfig.from_dict({**raw, "layer_types": ["chunked_attention"] * layers})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "multiple of"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"vocab_size": -5}, "vocab_size"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
        ({"head_dim": 15}, "even"),
    ],
)
def test_validation_errors(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(base(**overrides))


def test_frozen() -> None:
    config = ModelConfig.from_dict(base())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.vocab_size = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("generation", "expected_eos", "expected_bos"),
    [
        (None, (1,), 0),
        ({"eos_token_id": 7}, (7,), 0),
        ({"eos_token_id": [7, 9, 7], "bos_token_id": 5}, (7, 9), 5),
        ({"eos_token_id": None}, (1,), 0),
    ],
)
def test_eos_and_bos_from_generation_config(generation, expected_eos, expected_bos) -> None:
    config = ModelConfig.from_dict(base(), generation_config=generation)
    assert config.eos_token_ids == expected_eos
    assert config.bos_token_id == expected_bos


def test_eos_list_in_config_json() -> None:
    assert ModelConfig.from_dict(base(eos_token_id=[2, 3])).eos_token_ids == (2, 3)
    with pytest.raises(ValueError, match="eos_token_id"):
        ModelConfig.from_dict(base(eos_token_id="</s>"))


def test_from_folder(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_folder(folder)
    (folder / "config.json").write_text(json.dumps(base(tie_word_embeddings=True)))
    config = ModelConfig.from_folder(folder)
    assert config.name == "my-model" and config.tie_word_embeddings
    assert config.eos_token_ids == (1,)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    assert ModelConfig.from_folder(str(folder)).eos_token_ids == (1, 4)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_folder(folder)


def test_reads_what_transformers_writes(tiny_qwen3_dir: Path) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny_qwen3_dir)
    config = ModelConfig.from_folder(tiny_qwen3_dir)
    assert config.architecture == hf.model_type == "qwen3"
    assert config.head_dim == hf.head_dim
    assert config.num_key_value_heads == hf.num_key_value_heads
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.vocab_size == hf.vocab_size
    assert config.qk_norm
