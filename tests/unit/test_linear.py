"""MergedLinear: one matrix product computes what the merged Hugging Face layers compute,
on every path (transposed weight, MKL-packed weight for decode-sized batches, with and
without bias), and a merged model gives the unmerged model's logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.worker.models.linear import PACKED_ROWS, MergedLinear


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


@pytest.mark.parametrize("bias", [False, True])
def test_packed_weights_give_the_same_products(bias):
    merged = MergedLinear.merge(_layers(bias))
    plain = {}
    with torch.no_grad():
        inputs = {rows: torch.randn(rows, 48) for rows in (1, 2, 7, 16, 32, 33, 64)}
        for rows, x in inputs.items():
            plain[rows] = merged(x)
        packed_bytes = merged.pack()
        if not packed_bytes:
            pytest.fail("MKL packing is unavailable in this torch build")
        assert merged.packed is not None
        for rows, x in inputs.items():
            torch.testing.assert_close(merged(x), plain[rows], atol=1e-5, rtol=1e-5)
    assert 2 in PACKED_ROWS and 32 in PACKED_ROWS and 1 not in PACKED_ROWS


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
    for pack in (False, True):
        model, config = load_model(tiny_llama_dir, torch.float32)
        if pack:
            assert model.pack_weights() > 0
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
    for unpacked, packed in zip(*outputs, strict=True):
        torch.testing.assert_close(packed, unpacked, atol=1e-4, rtol=1e-4)
