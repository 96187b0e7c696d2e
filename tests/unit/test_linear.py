"""MergedLinear: one matrix product computes what the merged Hugging Face layers compute,
on every path (transposed weight; MKL's, oneDNN's and Tandem's packed weights for
decode-sized batches, with and without bias; the plan `auto` measures), and a packed model
gives the unpacked model's logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.worker.models import cpu_gemm
from services.worker.models.compact_panels import BLOCK_PANEL_ROWS
from services.worker.models.gemm_plan import MEASURED_ROWS, STATIC_ROWS, GemmPlan
from services.worker.models.linear import MergedLinear


def _layers(bias: bool) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(48, n, bias=bias) for n in (32, 16, 16)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 32, 40, 200])
def test_merged_equals_separate_layers(bias, rows):
    layers = _layers(bias)
    merged = MergedLinear.merge(layers)
    assert merged.transposed and merged.weight.shape == (48, 64)
    x = torch.randn(rows, 48)
    with torch.no_grad():
        expected = [layer(x) for layer in layers]
        parts = merged.split(x)
    assert [p.shape for p in parts] == [e.shape for e in expected]
    for part, want in zip(parts, expected, strict=True):
        torch.testing.assert_close(part, want, atol=1e-5, rtol=1e-5)


def test_this_box_offers_every_packed_format():
    assert cpu_gemm.available_formats() == ("mkl", "onednn", "tandem")


@pytest.mark.parametrize("fmt", ["mkl", "onednn", "tandem"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_weights_give_the_same_products(fmt, bias):
    merged = MergedLinear.merge(_layers(bias))
    plain = {}
    with torch.no_grad():
        inputs = {rows: torch.randn(rows, 48) for rows in (1, 2, 7, 16, 32, 33, 64, 65, 200)}
        for rows, x in inputs.items():
            plain[rows] = merged(x)
        plan = cpu_gemm.plan_for(fmt, [merged.weight])
        assert plan.packed_format == fmt and plan.packed_rows == frozenset(STATIC_ROWS[fmt])
        assert merged.pack(plan) >= merged.weight.numel() * 4
        assert merged.packed is not None and merged.plan is plan
        for rows, x in inputs.items():
            torch.testing.assert_close(merged(x), plain[rows], atol=1e-5, rtol=1e-5)


def test_a_weight_of_bfloat16_values_takes_bfloat16_panels_and_the_same_products():
    merged = MergedLinear.merge(_layers(True))
    with torch.no_grad():
        merged.weight.copy_(merged.weight.to(torch.bfloat16).float())
        float_panels = torch.ops.tandem_cpu.pack_linear_weight(merged.weight)
        plan = cpu_gemm.plan_for("tandem", [merged.weight])
        assert merged.pack(plan) == float_panels.numel() * 2
        assert merged.packed.dtype == torch.bfloat16
        for rows in (1, 16, 65):
            x = torch.randn(rows, 48)
            want = torch.ops.tandem_cpu.packed_linear(
                x, float_panels, merged.out_features, merged.bias
            )
            assert torch.equal(merged(x), want)


def test_a_weight_of_q4_1_blocks_keeps_them_for_small_products_only(monkeypatch):
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    torch.manual_seed(0)
    merged = MergedLinear.merge([nn.Linear(64, n) for n in (32, 16, 16)])
    with torch.no_grad():  # the values GGUF's Q4_1 gives: blocks of 32 along each row
        row_major = merged.weight.t().contiguous().numpy()
        q4 = GGMLQuantizationType.Q4_1
        exact = gguf_quants.dequantize(gguf_quants.quantize(row_major, q4), q4)
        merged.weight.copy_(torch.from_numpy(exact).t())
        float_panels = torch.ops.tandem_cpu.pack_linear_weight(merged.weight)
        merged.pack(cpu_gemm.plan_for("tandem", [merged.weight]))
    assert merged.blocks is not None and merged.blocks.dtype == torch.uint8
    calls = []
    real = torch.ops.tandem_cpu.packed_linear
    monkeypatch.setattr(
        torch.ops.tandem_cpu, "packed_linear", lambda x, p, *a: calls.append(p) or real(x, p, *a)
    )
    for rows in (1, BLOCK_PANEL_ROWS, BLOCK_PANEL_ROWS + 1, 70):
        x = torch.randn(rows, 64)
        want = real(x, float_panels, merged.out_features, merged.bias)
        assert torch.equal(merged(x), want)
        assert (calls[-1] is merged.blocks) == (rows <= BLOCK_PANEL_ROWS)


def test_every_row_count_of_a_plan_takes_its_packed_product(monkeypatch):
    merged = MergedLinear.merge(_layers(False))
    merged.pack(GemmPlan("onednn", frozenset({3})))
    calls = []
    real = cpu_gemm.packed_product
    monkeypatch.setattr(
        cpu_gemm, "packed_product", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    with torch.no_grad():
        for rows in (1, 2, 3, 4):
            merged(torch.randn(rows, 48))
    assert calls == [3]


def test_prompt_sized_inputs_take_the_packed_product_from_the_plans_packed_from(monkeypatch):
    merged = MergedLinear.merge(_layers(True))
    merged.pack(GemmPlan("tandem", frozenset({1}), packed_from=100))
    calls = []
    real = cpu_gemm.packed_product
    monkeypatch.setattr(
        cpu_gemm, "packed_product", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    with torch.no_grad():
        for rows in (1, 2, 99, 100, 300):
            x = torch.randn(rows, 48)
            want = torch.addmm(merged.bias, x, merged.weight)
            torch.testing.assert_close(merged(x), want, atol=1e-5, rtol=1e-5)
    assert calls == [1, 100, 300]


def test_auto_measures_every_format_and_keeps_a_consistent_plan():
    torch.manual_seed(0)
    weights = [torch.randn(256, 512), torch.randn(512, 256)]
    timings = cpu_gemm.measure(weights, ("mkl", "onednn", "tandem"), rows=(1, 4, 16), repeats=1)
    assert set(timings) == {"plain", "mkl", "onednn", "tandem"}
    assert all(set(t) == {1, 4, 16} and min(t.values()) > 0 for t in timings.values())
    plan = cpu_gemm.plan_for("auto", weights)
    assert plan.timings_us is not None
    assert set(plan.timings_us) == {"plain", "mkl", "onednn", "tandem"}
    if plan.packed_format is not None:
        assert plan.packed_rows and max(plan.packed_rows) <= max(MEASURED_ROWS)


def test_a_plan_without_packing_packs_nothing():
    merged = MergedLinear.merge(_layers(False))
    assert merged.pack(cpu_gemm.PLAIN) == 0 and merged.packed is None
    with pytest.raises(ValueError, match="cpu_gemm"):
        cpu_gemm.plan_for("blas", [merged.weight])


def test_three_dimensional_inputs_keep_their_shape():
    merged = MergedLinear.merge(_layers(True))
    x = torch.randn(2, 5, 48)
    with torch.no_grad():
        assert merged(x).shape == (2, 5, 64)
        torch.testing.assert_close(merged(x)[1], merged(x[1]))


def test_merge_refuses_mixed_bias():
    with pytest.raises(ValueError, match="bias"):
        MergedLinear.merge([nn.Linear(4, 4, bias=True), nn.Linear(4, 4, bias=False)])


@torch.inference_mode()
def test_packed_model_gives_the_unpacked_logits(tiny_llama_dir):
    from services.worker.kv_cache import KvCache
    from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata
    from services.worker.models.weight_loader import load_model

    outputs = []
    for pack in (None, "mkl", "onednn", "tandem"):
        model, config = load_model(tiny_llama_dir, torch.float32)
        if pack:
            assert model.pack_weights(pack)[0] > 0
        cache = KvCache(
            16,
            4,
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            torch.float32,
        )
        logits = []
        for slices in (
            [SequenceSlice(0, 5, [0, 1]), SequenceSlice(0, 3, [2])],
            [SequenceSlice(5, 1, [0, 1]), SequenceSlice(3, 1, [2])],
        ):
            positions, meta = build_attention_metadata(slices, 4, "cpu")
            ids = torch.arange(3, 3 + meta.num_tokens)
            logits.append(model.compute_logits(model(ids, positions, cache, meta)))
        outputs.append(logits)
    for unpacked, *packed in zip(*outputs, strict=True):
        for logits in packed:
            torch.testing.assert_close(logits, unpacked, atol=1e-4, rtol=1e-4)


def test_a_plan_already_made_is_used_as_is(tiny_llama_dir):
    """A draft model packs with its target's plan: no second measurement at load."""
    from services.worker.models.gemm_plan import static_plan
    from services.worker.models.weight_loader import load_model

    model, _ = load_model(tiny_llama_dir, torch.float32)
    plan = static_plan("onednn")
    packed_bytes, used = model.pack_weights(plan)
    assert used is plan and packed_bytes > 0
    layers = [m for m in model.modules() if isinstance(m, MergedLinear) and m.packable]
    assert layers and all(m.plan is plan and m.plan.packed_format == "onednn" for m in layers)
