"""Decode CUDA graphs: bucketing, static buffers and padding. On CPU the static-buffer path
runs eagerly (that is what exercises the padding logic here); the capture/replay tests run
only where CUDA is present and skip cleanly elsewhere."""

import pytest
import torch

from services.worker.cuda_graphs import DecodeGraphs, graph_buckets
from services.worker.kv_cache import KvCache
from services.worker.models.attention_backend import select_backend
from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata
from services.worker.models.weight_loader import load_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_buckets_cover_every_size_up_to_the_maximum():
    assert graph_buckets(1) == (1,)
    assert graph_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert graph_buckets(256)[-1] == 256 and 48 in graph_buckets(256)
    with pytest.raises(ValueError):
        graph_buckets(0)


def prefilled(model_dir, device, backend="auto"):
    """A model, a cache, and 5 sequences of different lengths with their prompts computed."""
    model, config = load_model(
        model_dir, torch.float32, device, attention=select_backend(backend, torch.device(device))
    )
    cache = KvCache(
        64,
        4,
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        torch.float32,
        device,
    )
    lengths = [3, 9, 4, 13, 6]
    tables, start = [], 1  # block 0 stays unused: padded rows read it
    for n in lengths:
        blocks = -(-(n + 4) // 4)
        tables.append(list(range(start, start + blocks)))
        start += blocks
    slices = [SequenceSlice(0, n, t) for n, t in zip(lengths, tables, strict=True)]
    positions, meta = build_attention_metadata(slices, 4, device)
    ids = torch.randint(3, 500, (sum(lengths),), device=device)
    model(ids, positions, cache, meta)
    return model, cache, lengths, tables


def decode_batch(lengths, tables, device):
    slices = [SequenceSlice(n, 1, t) for n, t in zip(lengths, tables, strict=True)]
    positions, meta = build_attention_metadata(slices, 4, device)
    ids = torch.randint(3, 500, (len(lengths),), device=device)
    return ids, positions, meta


@torch.inference_mode()
def test_static_buffer_path_pads_and_matches_the_eager_forward(tiny_llama_dir):
    model, cache, lengths, tables = prefilled(tiny_llama_dir, "cpu")
    graphs = DecodeGraphs(model, cache, graph_buckets(8), max_model_len=64, capture=False)
    ids, positions, meta = decode_batch(lengths, tables, "cpu")
    assert graphs.supports(meta) and graphs.bucket_for(len(lengths)) == 8
    before = cache.data.clone()
    hidden = graphs.run(ids, positions, meta)
    after_graph = cache.data.clone()
    # Only the five real slots were written; the three padded rows wrote nothing.
    changed = (before != after_graph).flatten(1).any(dim=1).nonzero().flatten().tolist()
    expected_blocks = sorted({t[n // 4] for n, t in zip(lengths, tables, strict=True)})
    assert changed == expected_blocks
    cache.data.copy_(before)
    eager = model(ids, positions, cache, meta)
    torch.testing.assert_close(hidden, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.data, after_graph)


def test_prompt_steps_and_oversized_batches_are_not_replayed(tiny_llama_dir):
    model, cache, lengths, tables = prefilled(tiny_llama_dir, "cpu")
    graphs = DecodeGraphs(model, cache, graph_buckets(4), max_model_len=64, capture=False)
    _, _, meta = decode_batch(lengths, tables, "cpu")  # 5 decodes > largest bucket 4
    assert not graphs.supports(meta)
    _, prefill_meta = build_attention_metadata([SequenceSlice(0, 3, [1])], 4, "cpu")
    assert not graphs.supports(prefill_meta)


@needs_cuda
@torch.inference_mode()
def test_captured_graphs_replay_exactly_like_eager(tiny_llama_dir):
    model, cache, lengths, tables = prefilled(tiny_llama_dir, "cuda", backend="triton")
    graphs = DecodeGraphs(model, cache, graph_buckets(8), max_model_len=64)
    graphs.capture_all()
    assert graphs.num_graphs == len(graph_buckets(8))
    ids, positions, meta = decode_batch(lengths, tables, "cuda")
    before = cache.data.clone()
    replayed = graphs.run(ids, positions, meta).clone()
    cache.data.copy_(before)
    eager = model(ids, positions, cache, meta)
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)


@needs_cuda
@torch.inference_mode()
def test_captured_graphs_take_each_rows_rope_length(tmp_path):
    """Dynamic RoPE past its maximum (8): each row's rope length reaches the captured
    graph through its static buffer, so replays with other lengths than at capture (rows
    past 8 and not; then every row as if its prompt were 20 tokens) equal eager passes."""
    from devtools.checkpoint_builder import build_checkpoint

    folder = build_checkpoint(
        tmp_path / "dynamic",
        max_position_embeddings=8,
        rope_scaling={"rope_type": "dynamic", "factor": 8.0},
    )
    model, cache, lengths, tables = prefilled(folder, "cuda", backend="triton")
    graphs = DecodeGraphs(model, cache, graph_buckets(8), max_model_len=64)
    graphs.capture_all()
    for prompt_len in (0, 20):
        slices = [SequenceSlice(n, 1, t, prompt_len) for n, t in zip(lengths, tables, strict=True)]
        positions, meta = build_attention_metadata(slices, 4, "cuda")
        ids = torch.randint(3, 500, (len(lengths),), device="cuda")
        before = cache.data.clone()
        replayed = graphs.run(ids, positions, meta).clone()
        cache.data.copy_(before)
        eager = model(ids, positions, cache, meta)
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
        cache.data.copy_(before)
