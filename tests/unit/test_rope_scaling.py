"""RoPE scaling types yarn, dynamic and longrope: frequencies and attention factors equal to
transformers' `ROPE_INIT_FUNCTIONS`, cos/sin equal to what `LlamaRotaryEmbedding` gives
under `generate` (one call for the prompt, one per new token), config validation, the rope
lengths the metadata carries, the CUDA-graph static buffers, and the prefix-cache key."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from common.model_config import ModelConfig
from common.prefix_hash import root_hash
from common.rope_config import max_context_length, prompt_rope_key, rope_length_threshold
from services.scheduler.worker_types import ModelShape
from services.worker.cuda_graphs import DecodeGraphs, graph_buckets
from services.worker.kv_cache import KvCache
from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata
from services.worker.models.rope import RotaryEmbedding, attention_factor, inverse_frequencies

HEAD_DIM = 32
SHORT = [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)]
LONG = [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)]
# name -> (rope parameters, max_position_embeddings)
SCALINGS = {
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 128),
    "yarn-int-factor-untruncated": (
        {
            "rope_type": "yarn",
            "factor": 8,
            "original_max_position_embeddings": 16,
            "beta_fast": 16,
            "beta_slow": 2,
            "truncate": False,
        },
        128,
    ),
    "yarn-deepseek-mscale": (
        {
            "rope_type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
        163840,
    ),
    "yarn-attention-factor": (
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 64,
            "attention_factor": 1.25,
        },
        128,
    ),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, 32),
    "dynamic-int-factor": ({"rope_type": "dynamic", "factor": 2}, 48),
    "longrope": (
        {
            "rope_type": "longrope",
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": 32,
        },
        128,
    ),
    "longrope-factor": (
        {
            "rope_type": "longrope",
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": 32,
            "factor": 16.0,
        },
        128,
    ),
}


def raw_config(rope: dict, max_positions: int, theta: float = 10000.0, **extra) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 4 * HEAD_DIM,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": max_positions,
        "rope_theta": theta,
        "rope_scaling": dict(rope),
        **extra,
    }


def configs(name: str) -> tuple[ModelConfig, LlamaConfig]:
    rope, max_positions = SCALINGS[name]
    ours = ModelConfig.from_dict(raw_config(rope, max_positions))
    hf = LlamaConfig.from_dict(raw_config(rope, max_positions))
    return ours, hf


def ours_rope(config: ModelConfig) -> RotaryEmbedding:
    return RotaryEmbedding(
        config.head_dim,
        config.max_position_embeddings,
        config.rope_theta,
        dict(config.rope_scaling),
    )


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("seq_len", [None, 17, 33, 48, 129, 500])
def test_frequencies_and_attention_factor_equal_transformers(name: str, seq_len) -> None:
    ours, hf = configs(name)
    rope_type = ours.rope_type
    hf_seq = None if seq_len is None else torch.tensor(seq_len)  # as dynamic_rope_update has it
    expected, factor = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", seq_len=hf_seq)
    got = inverse_frequencies(
        HEAD_DIM,
        ours.rope_theta,
        dict(ours.rope_scaling),
        max_position_embeddings=ours.max_position_embeddings,
        seq_len=seq_len,
    )
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert attention_factor(dict(ours.rope_scaling)) == factor


def hf_generate_tables(hf: LlamaConfig, prompt_len: int, total: int) -> tuple[torch.Tensor, ...]:
    """cos and sin (half width) that a fresh `LlamaRotaryEmbedding` gives each position
    under `generate`: the prompt in one call, then one call per token."""
    rope = LlamaRotaryEmbedding(hf)
    calls = [list(range(prompt_len))] + [[p] for p in range(prompt_len, total)]
    cos, sin = zip(*(rope(torch.zeros(1), torch.tensor([c])) for c in calls), strict=True)
    return torch.cat(cos, 1)[0, :, : HEAD_DIM // 2], torch.cat(sin, 1)[0, :, : HEAD_DIM // 2]


@pytest.mark.parametrize("name", ["yarn", "dynamic", "dynamic-int-factor", "longrope"])
@pytest.mark.parametrize("prompt_len", [5, 20, 32, 33, 70])
def test_tables_equal_transformers_under_generate(name: str, prompt_len: int) -> None:
    """Each token's cos/sin at rope length max(prompt, position + 1) are bit-identical to
    HF's, for prompts below, at and past the threshold, generating across it."""
    ours, hf = configs(name)
    total = min(max_context_length(ours), prompt_len + 60)
    expected_cos, expected_sin = hf_generate_tables(hf, prompt_len, total)
    positions = torch.arange(total)
    lengths = torch.clamp(positions + 1, min=prompt_len)
    rope = ours_rope(ours)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(prompt_len))
    cos, sin = rope.tables(positions[order], torch.float32, lengths[order])  # any batching
    assert torch.equal(cos[:, 0], expected_cos[order])
    assert torch.equal(sin[:, 0], expected_sin[order])


def test_dynamic_serves_factor_times_its_maximum_and_rotates_short_sequences_as_default() -> None:
    ours, _ = configs("dynamic")
    assert max_context_length(ours) == 128 and rope_length_threshold(ours) == 32
    rope, plain = ours_rope(ours), RotaryEmbedding(HEAD_DIM, 32, ours.rope_theta)
    positions = torch.arange(32)
    short = rope.tables(positions, torch.float32, positions + 1)
    default = plain.tables(positions, torch.float32)
    assert torch.equal(short[0], default[0]) and torch.equal(short[1], default[1])
    grown = rope.tables(positions, torch.float32, torch.full_like(positions, 100))
    assert not torch.equal(grown[0], short[0])


def test_length_dependent_metadata_carries_each_tokens_rope_length() -> None:
    slices = [
        SequenceSlice(0, 4, [0, 1], num_prompt_tokens=6),  # first chunk of a 6-token prompt
        SequenceSlice(9, 1, [2, 3, 4], num_prompt_tokens=5),  # a decode past its prompt
        SequenceSlice(2, 2, [5]),  # prompt length unknown: position + 1
    ]
    positions, meta = build_attention_metadata(slices, 4, "cpu")
    assert positions.tolist() == [0, 1, 2, 3, 9, 2, 3]
    assert meta.rope_lengths.tolist() == [6, 6, 6, 6, 10, 3, 4]


@torch.inference_mode()
def test_decode_graph_buffers_carry_rope_lengths(tmp_path) -> None:
    """The CUDA-graph path (its static buffers, run eagerly on CPU) hands the model each
    row's rope length: a one-token chunk in the middle of a long prompt is rotated as of
    the prompt's length there too."""
    from devtools.checkpoint_builder import build_checkpoint
    from services.worker.models.weight_loader import load_model

    rope, max_positions = SCALINGS["longrope"]
    rope = {**rope, "short_factor": SHORT[:8], "long_factor": LONG[:8]}  # head_dim 16
    folder = build_checkpoint(
        tmp_path / "m", max_position_embeddings=max_positions, rope_scaling=rope
    )
    model, config = load_model(folder, torch.float32)
    cache = KvCache(16, 4, config.num_hidden_layers, config.num_key_value_heads, 16, torch.float32)
    blocks = list(range(1, 12))
    prompt = torch.randint(3, 500, (40,))
    positions, meta = build_attention_metadata([SequenceSlice(0, 20, blocks, 40)], 4, "cpu")
    model(prompt[:20], positions, cache, meta)
    positions, meta = build_attention_metadata([SequenceSlice(20, 1, blocks, 40)], 4, "cpu")
    graphs = DecodeGraphs(model, cache, graph_buckets(2), max_model_len=64, capture=False)
    assert graphs.supports(meta) and meta.rope_lengths.tolist() == [40]
    before = cache.data.clone()
    replayed = graphs.run(prompt[20:21], positions, meta)
    cache.data.copy_(before)
    eager = model(prompt[20:21], positions, cache, meta)
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
    cache.data.copy_(before)
    as_decode = build_attention_metadata([SequenceSlice(20, 1, blocks)], 4, "cpu")[1]
    assert not torch.allclose(model(prompt[20:21], positions, cache, as_decode), eager)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"rope_type": "ntk-by-parts", "factor": 2.0}, "unsupported rope type 'ntk-by-parts'"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 32}, "yarn.*'factor'"),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": "x"}, "yarn.*'beta_fast'"),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, "yarn.*'truncate'"),
        ({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0}, "'attention_factor'"),
        ({"rope_type": "dynamic"}, "dynamic.*'factor'"),
        ({"rope_type": "dynamic", "factor": 0}, "dynamic.*'factor' must be positive"),
        ({"rope_type": "longrope", "short_factor": SHORT}, "longrope.*'long_factor'"),
        (
            {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG[:3]},
            "'long_factor' has 3 entries, head_dim 32 needs 16",
        ),
        (
            {"rope_type": "longrope", "short_factor": ["a"] * 16, "long_factor": LONG},
            "longrope.*'short_factor'",
        ),
    ],
)
def test_invalid_scaling_is_refused_in_one_line(raw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as error:
        ModelConfig.from_dict(raw_config(raw, 128))
    assert "\n" not in str(error.value)


def test_scaling_parses_from_both_layouts_and_stays_hashable() -> None:
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    v4 = ModelConfig.from_dict(raw_config({**yarn, "mscale": None, "unknown": 1}, 128))
    v5 = raw_config({}, 128)
    del v5["rope_scaling"], v5["rope_theta"]
    v5["rope_parameters"] = {**yarn, "rope_theta": 10000.0}
    assert v4 == ModelConfig.from_dict(v5) and v4.rope_type == "yarn"
    assert dict(v4.rope_scaling) == yarn  # None and unknown keys dropped
    longrope = ModelConfig.from_dict(raw_config(SCALINGS["longrope"][0], 128))
    hash(longrope)  # factor lists became tuples
    assert dict(longrope.rope_scaling)["factor"] == 4.0  # transformers' implicit factor
    # A top-level original_max_position_embeddings wins, as transformers' models have it.
    phi3 = raw_config(SCALINGS["longrope"][0], 128, original_max_position_embeddings=16)
    assert dict(ModelConfig.from_dict(phi3).rope_scaling)["original_max_position_embeddings"] == 16
    hf = LlamaRotaryEmbedding(LlamaConfig.from_dict(phi3))
    assert attention_factor(dict(ModelConfig.from_dict(phi3).rope_scaling)) == hf.attention_scaling


def test_prompt_rope_key_splits_prefix_cache_roots_only_where_kv_depends_on_it() -> None:
    dynamic, longrope = configs("dynamic")[0], configs("longrope")[0]
    assert (rope_length_threshold(dynamic), rope_length_threshold(longrope)) == (32, 32)
    assert rope_length_threshold(configs("yarn")[0]) == 0
    assert prompt_rope_key("yarn", 0, 500) == ""
    assert prompt_rope_key("dynamic", 32, 32) == prompt_rope_key("longrope", 32, 20) == ""
    assert prompt_rope_key("dynamic", 32, 33) != prompt_rope_key("dynamic", 32, 34)
    assert prompt_rope_key("longrope", 32, 33) == prompt_rope_key("longrope", 32, 90) != ""
    shape = ModelShape("m", "llama", 64, 128, (1,), "float32", 1, 4, 32, (), "longrope", 32)
    salt = b"salt"
    assert root_hash(salt, "", "", shape.prompt_rope_key(10)) == root_hash(salt)
    assert root_hash(salt, "", "", shape.prompt_rope_key(40)) != root_hash(salt)
