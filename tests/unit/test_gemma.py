"""Gemma's own pieces (`services/worker/models/gemma.py`) against transformers': the (1 + w)
RMSNorm in float32 and bfloat16, GeGLU; and whole tied Gemma 2 / Gemma 3 models over the
paged cache through each attention path that is not the default's (the plain-torch backend,
and the CPU path without its C++ kernels: SDPA's stand-in for soft-capped prompts and
decodes), logits equal to HF's; and split over two tensor-parallel ranks (each its heads,
inner slice and vocabulary rows). The default path's chunked prefill, mixed batches and
greedy generation are `test_model_parity.py`'s gemma cases.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.activations import ACT2FN
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

from common.model_config import ModelConfig
from devtools.checkpoint_builder import build_checkpoint
from kernels import cpu_ops
from services.worker.models.attention_backend import TorchAttention
from services.worker.models.gemma import GemmaForCausalLM, GemmaRMSNorm, gelu_tanh_and_mul
from services.worker.models.weight_loader import load_model
from tests.hf_reference import hf_greedy, hf_log_softmax
from tests.unit.test_model_parity import PagedSession, random_tokens, reference_logits
from tests.unit.test_tensor_parallel_model import NEW_TOKENS, run_group

ATOL = RTOL = 1e-4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
CHECKPOINTS = {
    "gemma3-tied": (
        "gemma3_text",
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "seed": 21},
    ),
    "gemma2-tied": (
        "gemma2",
        {
            "config_overrides": {"attn_logit_softcapping": 1.0, "query_pre_attn_scalar": 8},
            "seed": 22,
        },
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [True, False], ids=["cpp", "torch"])
def test_rms_norm_is_hf_gemma_norm(dtype, kernels, monkeypatch) -> None:
    if not kernels:
        monkeypatch.setattr(cpu_ops, "available", lambda: False)
    generator = torch.Generator().manual_seed(0)
    weight = 0.3 * torch.randn(48, generator=generator)
    x, residual = (3 * torch.randn(7, 48, generator=generator) for _ in range(2))
    reference = Gemma2RMSNorm(48, eps=1e-6)  # float32 weights, as transformers loads them
    reference.weight.data.copy_(weight.to(dtype).float())
    ours = GemmaRMSNorm(48, 1e-6, dtype)
    ours.weight.data.copy_(weight.to(dtype))
    x, residual = x.to(dtype), residual.to(dtype)
    for folded in (False, True):
        if folded:
            ours.fold()
        expected = reference(x)
        total, normed = ours.add_forward(residual, x)
        if dtype == torch.float32 and kernels:  # C++: the same sums in another order
            torch.testing.assert_close(ours(x), expected, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(normed, reference(residual + x), atol=1e-6, rtol=1e-6)
        else:  # transformers' steps exactly
            assert torch.equal(ours(x), expected)
            assert torch.equal(normed, reference(residual + x))
        assert torch.equal(total, residual + x)


def test_geglu_is_hf_gelu_pytorch_tanh() -> None:
    gate_up = torch.randn(5, 2 * 24, generator=torch.Generator().manual_seed(1))
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(gelu_tanh_and_mul(gate_up), ACT2FN["gelu_pytorch_tanh"](gate) * up)


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    """(folder, HF model) of a tied Gemma with a window of 5 on layers 0 and 2."""
    architecture, extra = CHECKPOINTS[request.param]
    extra = dict(extra)
    overrides = {"layer_types": LAYER_TYPES, **extra.pop("config_overrides", {})}
    folder = build_checkpoint(
        tmp_path_factory.mktemp("gemma") / request.param,
        architecture,
        num_hidden_layers=3,
        sliding_window=5,
        tie_word_embeddings=True,
        config_overrides=overrides,
        **extra,
    )
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return folder, hf


def _paged_logits(model, config, tokens, block_size=4):
    """A 9-token and a 7-token chunk, then single-token decodes, over a shuffled table."""
    session = PagedSession(model, config, block_size)
    table = session.allocate(len(tokens))
    schedule = [(0, 9), (9, 7)] + [(pos, 1) for pos in range(16, len(tokens))]
    return torch.cat([session.step([(tokens, c, n, table)])[0] for c, n in schedule])


@pytest.mark.parametrize("path", ["torch-backend", "cpu-without-kernels"])
def test_tied_model_matches_hf_on_every_attention_path(checkpoint, path, monkeypatch) -> None:
    folder, hf = checkpoint
    if path == "cpu-without-kernels":
        monkeypatch.setattr(cpu_ops, "available", lambda: False)
        model, config = load_model(folder, dtype=torch.float32)
    else:
        model, config = load_model(folder, dtype=torch.float32, attention=TorchAttention())
    assert isinstance(model, GemmaForCausalLM) and config.tie_word_embeddings
    tokens = random_tokens(config, 24, seed=3)
    got = _paged_logits(model, config, tokens)
    torch.testing.assert_close(got, reference_logits(hf, tokens), atol=ATOL, rtol=RTOL)


def test_bfloat16_model_tracks_float32_reference(checkpoint) -> None:
    folder, hf = checkpoint
    model, config = load_model(folder, dtype=torch.bfloat16)
    tokens = random_tokens(config, 20, seed=4)
    expected = reference_logits(hf, tokens)
    session = PagedSession(model, config, block_size=8, dtype=torch.bfloat16)
    table = session.allocate(len(tokens))
    schedule = [(0, 12)] + [(pos, 1) for pos in range(12, 20)]
    got = torch.cat([session.step([(tokens, c, n, table)])[0] for c, n in schedule])
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75


def test_two_tensor_parallel_ranks_equal_hf(checkpoint, tmp_path) -> None:
    folder, _ = checkpoint
    prompt = [5, 17, 230, 9, 44, 101, 7, 12, 300, 41]  # past the window of 5
    want = hf_greedy(folder, prompt, NEW_TOKENS)
    reference = hf_log_softmax(folder, prompt)[-1]
    for rank, tokens, logits, _, kv_heads, _ in run_group(folder, 2, prompt, tmp_path):
        assert tokens == want, rank
        got = torch.log_softmax(torch.tensor(logits), -1)
        torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)
        assert kv_heads == 1  # of the model's 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_embedding_scale_is_hf_rounding(dtype) -> None:
    """The scaled embedding equals transformers' `embed(ids) * embed_scale.to(dtype)` (a 0-d
    tensor: sqrt(3072) = 55.4256 is 55.5 in bfloat16)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    raw = {"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 3072,
           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64}  # fmt: skip
    with torch.device("meta"):
        model = GemmaForCausalLM(ModelConfig.from_dict(raw), dtype=dtype)
    reference = Gemma3TextScaledWordEmbedding(64, 3072, 0, embed_scale=3072**0.5).to(dtype)
    ids = torch.arange(64)
    assert torch.equal(reference.weight.data[ids] * model.model.embed_scale, reference(ids))
    assert (model.model.embed_scale == 55.5) == (dtype == torch.bfloat16)
