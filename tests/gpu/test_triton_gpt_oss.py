"""gpt-oss on the Triton kernels: the fused mixture-of-experts (`kernels/fused_moe.py`) with
gpt-oss's expert biases and clamped SwiGLU against the model's own `moe.fused_experts`, whole
and expert-parallel (an expert range), with products large enough that the clamp bites; and
a whole tiny gpt-oss model on the Triton attention backend (sinks, sliding / full layers) with
its experts through `fused_moe`, against HF's logits. Without CUDA everything runs under the
Triton CPU interpreter (selected below, before the kernel modules are imported).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel definitions

import pytest  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from devtools.checkpoint_builder import build_checkpoint  # noqa: E402
from kernels.fused_moe import fused_moe  # noqa: E402
from services.worker.models import moe  # noqa: E402
from services.worker.models.attention_backend import TritonAttention  # noqa: E402
from services.worker.models.moe import ClampedSwiGLU, fused_experts  # noqa: E402
from services.worker.models.weight_loader import load_model  # noqa: E402
from tests.gpu.test_triton_fused_moe import DEVICE, HIDDEN, INNER, random_ids  # noqa: E402

SWIGLU = ClampedSwiGLU(1.702, 7.0)


def _layer(experts: int, gen: torch.Generator):
    """gate_up [E, 2I, H] scaled so that many products pass the clamp of 7, down [E, H, I],
    and their biases."""
    gate_up = 4 * torch.randn(experts, 2 * INNER, HIDDEN, generator=gen) / HIDDEN**0.5
    down = torch.randn(experts, HIDDEN, INNER, generator=gen) / INNER**0.5
    return (
        gate_up,
        down,
        torch.randn(experts, 2 * INNER, generator=gen),
        torch.randn(experts, HIDDEN, generator=gen),
    )


@pytest.mark.parametrize("expert_range", [None, (2, 3)], ids=["all", "ep-2..4"])
def test_fused_moe_with_biases_and_clamp_matches_fused_experts(expert_range) -> None:
    gen = torch.Generator().manual_seed(7)
    tokens, experts, top_k = 21, 6, 2
    x = torch.randn(tokens, HIDDEN, generator=gen)
    gate_up, down, gate_up_bias, down_bias = _layer(experts, gen)
    ids = random_ids(tokens, experts, top_k, gen)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1)
    assert (x @ gate_up[0, :INNER].T > SWIGLU.limit).any()  # the clamp bites here
    first, held = (0, experts) if expert_range is None else expert_range
    part = slice(first, first + held)
    layer = (gate_up[part], down[part], gate_up_bias[part], down_bias[part])
    expected = fused_experts(
        x, layer[0], layer[1], weights, ids, transposed=False,
        first_expert=None if expert_range is None else first, biases=layer[2:],
        activation=SWIGLU,
    )  # fmt: skip
    on = [t.to(DEVICE) for t in (x, *layer, weights, ids)]
    got = fused_moe(
        on[0], on[1], on[2], on[5], on[6], expert_offset=first, gate_up_bias=on[3],
        down_bias=on[4], swiglu_clamp=(SWIGLU.alpha, SWIGLU.limit),
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_fused_moe_refuses_a_lone_bias() -> None:
    gen = torch.Generator().manual_seed(0)
    gate_up, down, gate_up_bias, _ = _layer(2, gen)
    x, ids, weights = torch.randn(3, HIDDEN), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(ValueError, match="come together"):
        fused_moe(x, gate_up, down, weights, ids, gate_up_bias=gate_up_bias)


def _triton_experts(self, x, weights, experts):
    """`moe.Experts.forward` as on CUDA, on the CPU model's transposed weights (viewed back in
    HF's layout)."""
    return fused_moe(
        x, self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2), weights, experts,
        expert_offset=self.first_expert or 0, gate_up_bias=self.gate_up_proj_bias,
        down_bias=self.down_proj_bias,
        swiglu_clamp=(self.activation.alpha, self.activation.limit),
    )  # fmt: skip


@pytest.mark.skipif(DEVICE != "cpu", reason="drives the model through the CPU PagedSession")
def test_gpt_oss_model_on_triton_kernels_matches_hf(tmp_path, monkeypatch) -> None:
    from tests.unit.test_gpt_oss import YARN, _paged_logits
    from tests.unit.test_model_parity import random_tokens, reference_logits

    folder = build_checkpoint(
        tmp_path / "gpt-oss", "gpt_oss", num_hidden_layers=3, intermediate_size=64,
        sliding_window=6, rope_scaling=YARN, seed=44,
    )  # fmt: skip
    monkeypatch.setattr(moe.Experts, "forward", _triton_experts)
    model, config = load_model(folder, torch.float32, attention=TritonAttention())
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = random_tokens(config, 18, seed=6)  # past the window of 6
    got = _paged_logits(model, config, tokens)
    torch.testing.assert_close(got, reference_logits(hf, tokens), atol=1e-4, rtol=1e-4)
