"""ModelConfig on mixture-of-experts config.json files (Mixtral, Qwen3-MoE): the expert fields
parsed as transformers reads them, and everything Tandem does not compute refused with one
line naming the field (that a worker exits with that line: tests/service/test_e2e_moe.py)."""

from __future__ import annotations

import pytest

from common.model_config import ModelConfig
from tests.unit.test_model_config import base


def mixtral(**overrides) -> dict:
    """The llama test config (`test_model_config.base`) as a tiny Mixtral."""
    moe = {"model_type": "mixtral", "head_dim": None, "sliding_window": None,
           "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
           "router_jitter_noise": 0.0}  # fmt: skip
    return base(**{**moe, **overrides})


def qwen3_moe(**overrides) -> dict:
    """The llama test config as a tiny Qwen3-MoE of 4 layers."""
    moe = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "use_sliding_window": False,
           "sliding_window": 4096, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
           "mlp_only_layers": []}  # fmt: skip
    return base(**{**moe, **overrides})


def test_mixtral_is_mistral_attention_with_every_layer_sparse() -> None:
    config = ModelConfig.from_dict(mixtral())
    assert config.architecture == "mixtral" and not config.qk_norm
    assert not config.attention_bias and config.head_dim == 16
    moe = config.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.expert_intermediate_size) == (4, 2, 128)
    assert moe.norm_topk_prob  # Mixtral always renormalises
    assert all(config.is_moe_layer(i) for i in range(2))


def test_qwen3_moe_fields_and_dense_layers() -> None:
    config = ModelConfig.from_dict(qwen3_moe(mlp_only_layers=[0], decoder_sparse_step=2))
    assert config.qk_norm and config.head_dim == 16  # no head_dim: hidden / heads, not 128
    assert config.moe.expert_intermediate_size == 32 and config.intermediate_size == 128
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    plain = ModelConfig.from_dict(qwen3_moe(norm_topk_prob=None, decoder_sparse_step=None))
    assert not plain.moe.norm_topk_prob  # Qwen3MoeConfig's default
    assert [plain.is_moe_layer(i) for i in range(4)] == [True] * 4
    dense = ModelConfig.from_dict({**mixtral(), "model_type": "mistral"})
    assert dense.moe is None and not dense.is_moe_layer(0)


def test_qwen3_moe_expert_count_under_either_name() -> None:
    """`save_pretrained` writes Qwen3MoeConfig.num_experts as num_local_experts."""
    raw = qwen3_moe()
    raw["num_local_experts"] = raw.pop("num_experts")
    assert ModelConfig.from_dict(raw).moe.num_experts == 8
    assert ModelConfig.from_dict(qwen3_moe(num_local_experts=8)).moe.num_experts == 8
    with pytest.raises(ValueError, match="num_experts=8 and num_local_experts=6; they must agree"):
        ModelConfig.from_dict(qwen3_moe(num_local_experts=6))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (qwen3_moe(num_experts_per_tok=9), r"num_experts_per_tok \(9\) must not exceed .* \(8\)"),
        (mixtral(num_experts_per_tok=5), r"num_experts_per_tok \(5\) must not exceed .* \(4\)"),
        (qwen3_moe(num_experts_per_tok=0), "'num_experts_per_tok' must be a positive integer"),
        (qwen3_moe(num_experts=0), "'num_experts' must be a positive integer, got 0"),
        (qwen3_moe(num_experts=None), "missing required field 'num_experts'"),
        (qwen3_moe(moe_intermediate_size=None), "missing required field 'moe_intermediate_size'"),
        (mixtral(num_local_experts=None), "missing required field 'num_local_experts'"),
        (mixtral(num_experts_per_tok=None), "missing required field 'num_experts_per_tok'"),
        (qwen3_moe(shared_expert_intermediate_size=256), "shared_expert_intermediate_size=256"),
        (qwen3_moe(n_shared_experts=1), "n_shared_experts=1 is not supported"),
        (qwen3_moe(decoder_sparse_step=0), "decoder_sparse_step must be a positive integer"),
        (qwen3_moe(mlp_only_layers=[-1]), r"mlp_only_layers must list layer numbers"),
        (qwen3_moe(mlp_only_layers="0"), r"mlp_only_layers must be a list"),
        (qwen3_moe(norm_topk_prob="yes"), "norm_topk_prob must be true or false"),
        (mixtral(sliding_window=0), "sliding_window must be a positive integer"),
        ({**qwen3_moe(), "model_type": "qwen2_moe"}, "unsupported model_type 'qwen2_moe'"),
    ],
)
def test_unsupported_moe_configs_are_refused_in_one_line(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        ModelConfig.from_dict(raw)
    assert "\n" not in str(caught.value)


def test_moe_sliding_windows_cover_every_layer() -> None:
    """mixtral's `sliding_window` and qwen3_moe's (with `use_sliding_window`) window every
    layer, as transformers does (`common.sliding_window`)."""
    assert ModelConfig.from_dict(mixtral(sliding_window=256)).layer_windows == (256, 256)
    assert ModelConfig.from_dict(mixtral()).layer_windows is None
    windowed = ModelConfig.from_dict(qwen3_moe(use_sliding_window=True))
    assert windowed.layer_windows == (4096,) * 4
    assert ModelConfig.from_dict(qwen3_moe()).layer_windows is None
