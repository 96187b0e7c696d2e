"""gpt-oss (`services/worker/models/gpt_oss.py`, `gpt_oss_weights.py`, `mxfp4.py`) against
transformers: MXFP4 dequantization equal to transformers' conversion bit for bit; the
clamped SwiGLU equal to `GptOssExperts._apply_gate`; a tiny checkpoint whose experts this
test stores in MXFP4 (`devtools.mxfp4_checkpoint`) loads to exactly the dequantized experts
and generates HF's greedy tokens (HF loading the same MXFP4 folder, dequantizing on CPU),
through chunked prefill and decodes, on every attention path, and split over two ranks
(tensor parallel, and expert parallel). The default path's mixed batches and the
unquantized layout are `test_model_parity.py`'s gpt_oss case. Config defaults equal
`GptOssConfig`'s; what Tandem does not load is refused naming it.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from common.model_config import ModelConfig
from devtools.checkpoint_builder import build_checkpoint
from devtools.mxfp4_checkpoint import quantize_checkpoint_experts, quantize_mxfp4
from kernels import cpu_ops
from services.worker.models import mxfp4
from services.worker.models.attention_backend import TorchAttention
from services.worker.models.gpt_oss import GptOssForCausalLM
from services.worker.models.moe import ClampedSwiGLU
from services.worker.models.mxfp4 import dequantize_mxfp4
from services.worker.models.weight_loader import load_model
from tests.hf_reference import hf_greedy, hf_log_softmax
from tests.unit.test_model_parity import PagedSession, random_tokens, reference_logits
from tests.unit.test_tensor_parallel_model import NEW_TOKENS, run_group

ATOL = RTOL = 1e-4
WINDOW = 6
YARN = {  # gpt-oss's RoPE (truncate false, theta 150000), over a small original context
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(unquantized folder, MXFP4 folder): 3 layers (sliding / full / sliding, window 6),
    4 experts of inner size 64, top 2."""
    plain = build_checkpoint(
        tmp_path_factory.mktemp("gpt_oss") / "plain", "gpt_oss", num_hidden_layers=3,
        intermediate_size=64, sliding_window=WINDOW, rope_scaling=YARN, seed=41,
    )  # fmt: skip
    quantized = tmp_path_factory.mktemp("gpt_oss") / "mxfp4"
    shutil.copytree(plain, quantized)
    return plain, quantize_checkpoint_experts(quantized)


@pytest.fixture(scope="module")
def hf_mxfp4(folders):
    """transformers' model of the MXFP4 folder (on CPU it dequantizes the experts itself)."""
    return AutoModelForCausalLM.from_pretrained(
        folders[1], dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize("chunk", [None, 100], ids=["one-step", "in-steps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_mxfp4_is_transformers_conversion(dtype, chunk, monkeypatch) -> None:
    if chunk is not None:  # a few rows (of 128 values) per step
        monkeypatch.setattr(mxfp4, "CHUNK_VALUES", chunk * 3)
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=generator)
    for low, high in ((110, 140), (0, 256)):  # every exponent, 2^-127 .. 2^128 included
        scales = torch.randint(low, high, (3, 10, 4), dtype=torch.uint8, generator=generator)
        expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        got = dequantize_mxfp4(blocks, scales, dtype)
        assert got.dtype == dtype and got.shape == (3, 10, 128)
        assert torch.equal(got.nan_to_num(), expected.nan_to_num())
        assert torch.equal(got.isnan(), expected.isnan())


def test_dequantize_mxfp4_refuses_unpaired_parts() -> None:
    blocks = torch.zeros(2, 3, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.float(), torch.zeros(2, 3, dtype=torch.uint8))


def test_test_quantizer_rounds_to_the_nearest_fp4_value() -> None:
    """The test checkpoints' quantizer: values already on a block's FP4 grid come back
    exactly; others within half the grid's widest step (1 at the block's scale)."""
    generator = torch.Generator().manual_seed(1)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0])
    exact = grid[torch.randint(0, 8, (5, 64), generator=generator)] * 0.25
    exact[:, 0] = -6.0 * 0.25  # each block's largest magnitude sets its scale
    exact[:, 32] = 6.0 * 0.25
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(exact), torch.float32), exact)
    weight = torch.randn(5, 64, generator=generator)
    blocks, scales = quantize_mxfp4(weight)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    assert ((dequantize_mxfp4(blocks, scales, torch.float32) - weight).abs() <= step).all()


def test_clamped_swiglu_is_hf_apply_gate() -> None:
    config = GptOssConfig(hidden_size=8, intermediate_size=12, num_local_experts=2)
    interleaved = 6 * torch.randn(7, 24, generator=torch.Generator().manual_seed(2))
    expected = GptOssExperts(config)._apply_gate(interleaved)  # beyond the limit of 7 too
    grouped = torch.cat([interleaved[:, 0::2], interleaved[:, 1::2]], dim=-1)
    got = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)(grouped)
    assert torch.equal(got, expected)


def test_mxfp4_experts_load_as_the_dequantized_weights(folders) -> None:
    """Our experts (after loading: transposed on CPU, [E, H, gate | up] and [E, I, H]) are
    transformers' dequantization of the checkpoint's blocks, gate and up columns regrouped;
    the biases, router and sinks are the checkpoint's."""
    _, quantized = folders
    model, config = load_model(quantized, dtype=torch.float32)
    weights = load_file(quantized / "model.safetensors")
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}.mlp.experts."
        parts = {
            proj: convert_moe_packed_tensors(
                weights[prefix + proj + "_blocks"],
                weights[prefix + proj + "_scales"],
                dtype=torch.float32,
            )  # fmt: skip
            for proj in ("gate_up_proj", "down_proj")
        }
        gate_up = parts["gate_up_proj"]  # [E, H, 2I], gate and up interleaved
        experts = layer.mlp.experts
        assert experts.transposed
        assert torch.equal(
            experts.gate_up_proj, torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], -1)
        )
        assert torch.equal(experts.down_proj, parts["down_proj"])
        bias = weights[prefix + "gate_up_proj_bias"]
        assert torch.equal(experts.gate_up_proj_bias, torch.cat([bias[:, 0::2], bias[:, 1::2]], 1))
        assert torch.equal(experts.down_proj_bias, weights[prefix + "down_proj_bias"])
        sinks = weights[f"model.layers.{index}.self_attn.sinks"]
        assert torch.equal(layer.self_attn.sinks, sinks)
        assert layer.self_attn.window == (WINDOW if index != 1 else None)
    assert config.moe.num_experts == 4 and config.gpt_oss.swiglu_limit == 7.0


def _paged_logits(model, config, tokens, block_size=4):
    """A 9-token and a 7-token chunk, then single-token decodes, over a shuffled table."""
    session = PagedSession(model, config, block_size)
    table = session.allocate(len(tokens))
    schedule = [(0, 9), (9, 7)] + [(pos, 1) for pos in range(16, len(tokens))]
    return torch.cat([session.step([(tokens, c, n, table)])[0] for c, n in schedule])


@pytest.mark.parametrize("path", ["cpu", "torch-backend", "cpu-without-kernels"])
def test_mxfp4_model_matches_hf_on_every_attention_path(folders, hf_mxfp4, path, monkeypatch):
    _, quantized = folders
    if path == "cpu-without-kernels":
        monkeypatch.setattr(cpu_ops, "available", lambda: False)
    backend = TorchAttention() if path == "torch-backend" else None
    model, config = load_model(quantized, dtype=torch.float32, attention=backend)
    assert isinstance(model, GptOssForCausalLM)
    tokens = random_tokens(config, 24, seed=3)  # past the window of 6
    got = _paged_logits(model, config, tokens)
    torch.testing.assert_close(got, reference_logits(hf_mxfp4, tokens), atol=ATOL, rtol=RTOL)


def test_mxfp4_greedy_generation_matches_hf_generate(folders, hf_mxfp4) -> None:
    _, quantized = folders
    model, config = load_model(quantized, dtype=torch.float32)
    prompt = random_tokens(config, 11, seed=5)
    max_new = 20
    with torch.no_grad():
        out = hf_mxfp4.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new)
    reference = out[0, len(prompt) :].tolist()
    session = PagedSession(model, config, block_size=4)
    table = session.allocate(len(prompt) + max_new)
    tokens, computed, generated = list(prompt), 0, []
    while len(generated) < len(reference):
        (logits,) = session.step([(tokens, computed, len(tokens) - computed, table, len(prompt))])
        computed = len(tokens)
        tokens.append(int(logits[-1].argmax()))
        generated.append(tokens[-1])
    assert generated == reference
    assert len(set(generated)) >= 4, f"degenerate generation {generated}"


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_two_ranks_equal_hf(folders, expert_parallel, tmp_path) -> None:
    """TP=2: each rank half the heads, sinks and every expert's inner slice (down biases on
    rank 0); EP=2: half the experts each, whole, with their biases."""
    _, quantized = folders
    prompt = [5, 17, 230, 9, 44, 101, 7, 12, 300, 41]  # past the window of 6
    want = hf_greedy(quantized, prompt, NEW_TOKENS)
    reference = hf_log_softmax(quantized, prompt)[-1]
    results = run_group(quantized, 2, prompt, tmp_path, expert_parallel=expert_parallel)
    for rank, tokens, logits, _, kv_heads, (held, _) in results:
        assert tokens == want, rank
        got = torch.log_softmax(torch.tensor(logits), -1)
        torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)
        assert kv_heads == 1
        assert held == (range(2 * rank, 2 * rank + 2) if expert_parallel else range(4))


def test_bfloat16_model_tracks_float32_reference(folders, hf_mxfp4) -> None:
    model, config = load_model(folders[1], dtype=torch.bfloat16)
    tokens = random_tokens(config, 20, seed=4)
    expected = reference_logits(hf_mxfp4, tokens)
    session = PagedSession(model, config, block_size=8, dtype=torch.bfloat16)
    table = session.allocate(len(tokens))
    schedule = [(0, 12)] + [(pos, 1) for pos in range(12, 20)]
    got = torch.cat([session.step([(tokens, c, n, table)])[0] for c, n in schedule])
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75


def test_config_defaults_are_gpt_oss_configs() -> None:
    """Fields a config.json leaves out take `GptOssConfig`'s values."""
    raw = {"model_type": "gpt_oss", "num_hidden_layers": 4, "hidden_size": 64,
           "num_attention_heads": 16, "vocab_size": 256}  # fmt: skip
    ours = ModelConfig.from_dict(raw)
    hf = GptOssConfig(**raw)
    assert ours.layer_windows == tuple(
        hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types
    ) == (128, None, 128, None)  # fmt: skip
    assert (ours.head_dim, ours.num_key_value_heads, ours.intermediate_size) == (
        hf.head_dim, hf.num_key_value_heads, hf.intermediate_size)  # fmt: skip
    assert ours.attention_bias and hf.attention_bias
    assert ours.rope_theta == hf.rope_parameters["rope_theta"] == 150000.0
    scaling = dict(ours.rope_scaling)
    for key in ("rope_type", "factor", "beta_fast", "beta_slow", "truncate"):
        assert scaling[key] == hf.rope_parameters[key], key
    assert scaling["original_max_position_embeddings"] == 4096
    assert (ours.moe.num_experts, ours.moe.num_experts_per_tok) == (128, 4)
    assert (ours.gpt_oss.swiglu_alpha, ours.gpt_oss.swiglu_limit) == (1.702, 7.0)
    assert ours.rms_norm_eps == hf.rms_norm_eps and not ours.tie_word_embeddings


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"swiglu_limit": 0}, "gpt_oss swiglu_limit must be positive, got 0"),
        ({"swiglu_alpha": "fast"}, "gpt_oss swiglu_alpha must be a number, got 'fast'"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "unsupported layer_types"),
        ({"num_experts_per_tok": 8, "num_local_experts": 4}, "must not exceed"),
    ],
    ids=["limit", "alpha", "layer-type", "top-k"],
)
def test_config_refusals_name_the_field(fields, message) -> None:
    raw = {"model_type": "gpt_oss", "num_hidden_layers": 2, "hidden_size": 64,
           "num_attention_heads": 4, "vocab_size": 256, **fields}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_loader_refuses_other_quantizations_and_lone_mxfp4_parts(folders, tmp_path) -> None:
    _, quantized = folders
    folder = shutil.copytree(quantized, tmp_path / "awq")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        load_model(folder, dtype=torch.float32)
    folder = shutil.copytree(quantized, tmp_path / "lone")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.experts\.down_proj_blocks without"):
        load_model(folder, dtype=torch.float32)
