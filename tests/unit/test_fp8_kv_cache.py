"""The fp8 (e4m3) KV cache (`--kv-cache-dtype fp8`): four times the blocks of float32 and
twice those of bf16 in the same memory; whole blocks move byte for byte (gather, scatter,
swap copies, rank messages); the C++ decode kernel reads fp8 as the SDPA path does; the
checkpoint's k/v scales are applied (the pool holds K / k_scale); and on a briefly trained
tiny Llama, greedy choices agree with the float32 cache on >= 95% of tokens over 32 prompts
with a held-out perplexity within 1%."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import cpu_ops, cpu_paged_attention
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KvCache
from services.worker.models.attention_backend import select_backend
from services.worker.models.weight_loader import load_model
from services.worker.startup import resolve_kv_dtype
from tests.trained_checkpoint import held_out_text
from tests.unit.test_model_parity import PagedSession

FP8 = torch.float8_e4m3fn
GEOMETRY = dict(block_size=16, num_layers=4, num_kv_heads=2, head_dim=32)


def test_fp8_pool_holds_four_times_the_blocks_of_float32_and_twice_bf16():
    memory = 64 << 20
    blocks = {
        dtype: KvCache.num_blocks_for_bytes(memory, dtype=dtype, **GEOMETRY)
        for dtype in (torch.float32, torch.bfloat16, FP8)
    }
    assert blocks[FP8] == 4 * blocks[torch.float32] == 2 * blocks[torch.bfloat16]
    assert resolve_kv_dtype("fp8", torch.float32) == FP8
    assert resolve_kv_dtype("fp8_e4m3", torch.bfloat16) == FP8
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        WorkerConfig(model="/m", kv_cache_dtype="fp8_e5m2")


def test_fp8_blocks_move_byte_for_byte():
    cache = KvCache(num_blocks=8, dtype=FP8, **GEOMETRY)
    cache.data.view(torch.uint8).copy_(
        torch.randint(0, 0x7F, cache.data.shape, dtype=torch.uint8)  # finite fp8 codes
    )
    payload = cache.gather_blocks([5, 1, 6])
    assert payload.shape == (3, cache.block_bytes)
    other = KvCache(num_blocks=8, dtype=FP8, **GEOMETRY)
    other.scatter_blocks([0, 2, 7], payload)
    raw, got = cache.data.view(torch.uint8), other.data.view(torch.uint8)
    assert torch.equal(got[[0, 2, 7]], raw[[5, 1, 6]])
    assert not got[[1, 3, 4, 5, 6]].any()
    swap = KvCache(num_blocks=4, dtype=FP8, **GEOMETRY)
    swap.copy_blocks([(7, 3)], source=other)  # swap out, then in again
    other.copy_blocks([(3, 4)], source=swap)
    assert torch.equal(got[4], raw[6])


def test_cpu_decode_kernel_reads_fp8_as_sdpa_does():
    assert cpu_ops.available()  # built on this machine (make venv builds it)
    torch.manual_seed(0)
    k_cache = torch.randn(8, 16, 2, 16).to(FP8)
    v_cache = torch.randn(8, 16, 2, 16).to(FP8)
    query = torch.randn(3, 4, 16)
    tables, lens = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 0]]), [40, 33, 20]
    results = []
    for use_kernel in (True, False):
        plan = cpu_paged_attention.plan(
            torch.tensor([0, 1, 2]), tables, [0, 1, 2, 3], lens, 16, use_kernel=use_kernel
        )
        results.append(cpu_paged_attention._decode(query, k_cache, v_cache, plan, 0.25))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)


def greedy_batch(model, config, dtype, prompts, count, forced=None):
    """Every prompt decoded together, `count` tokens each: each step's greedy choices (and
    log-probabilities), the next inputs being `forced` (teacher forcing) or the choices."""
    session = PagedSession(model, config, block_size=4, dtype=dtype)
    tables = [session.allocate(len(p) + count) for p in prompts]
    tokens = [list(p) for p in prompts]
    work = [(t, 0, len(t), table) for t, table in zip(tokens, tables, strict=True)]
    choices, logprobs = [[] for _ in prompts], [[] for _ in prompts]
    for step in range(count):
        rows = session.step(work)
        for i, logits in enumerate(rows):
            choices[i].append(int(logits[-1].argmax()))
            logprobs[i].append(torch.log_softmax(logits[-1], -1))
            tokens[i].append(choices[i][-1] if forced is None else forced[i][step])
        work = [(t, len(t) - 1, 1, table) for t, table in zip(tokens, tables, strict=True)]
    return choices, logprobs


def test_fp8_cache_agrees_with_float32_and_keeps_perplexity(trained_llama_dir):
    """Agreement: 32 held-out prompts, 16 greedy tokens each from the float32 cache; the
    fp8 cache, fed the same tokens, chooses the same at >= 95% of positions (every choice
    a decode reading its whole context from the cache). Perplexity: the held-out text,
    token by token through the cache."""
    from transformers import AutoTokenizer

    backend = select_backend("cpu", torch.device("cpu"))
    model, config = load_model(trained_llama_dir, torch.float32, attention=backend)
    tokenizer = AutoTokenizer.from_pretrained(trained_llama_dir)
    held_out = tokenizer(held_out_text())["input_ids"]
    prompts = [held_out[i * 8 : i * 8 + 12] for i in range(32)]
    reference, _ = greedy_batch(model, config, torch.float32, prompts, 16)
    ours, _ = greedy_batch(model, config, FP8, prompts, 16, forced=reference)
    same = [a == b for r, o in zip(reference, ours, strict=True) for a, b in zip(r, o, strict=True)]
    agreement = sum(same) / len(same)
    assert agreement >= 0.95, agreement
    text = held_out[:200]
    nll = {}
    for dtype in (torch.float32, FP8):
        rest = text[8:]
        _, logprobs = greedy_batch(model, config, dtype, [text[:8]], len(rest), forced=[rest])
        nll[dtype] = -sum(float(lp[t]) for lp, t in zip(logprobs[0], rest, strict=True)) / len(rest)
    ppl32, ppl8 = math.exp(nll[torch.float32]), math.exp(nll[FP8])
    assert ppl8 / ppl32 - 1 <= 0.01, (ppl32, ppl8)
    assert ppl32 < config.vocab_size / 4  # the model learned something


def test_checkpoint_kv_scales_are_applied(trained_llama_dir, tmp_path):
    """k_scale / v_scale in the checkpoint (one per layer, or one per KV head): the fp8 pool
    holds K / k_scale, V / v_scale, and attention undoes them (logits track float32)."""
    import shutil

    folder = tmp_path / "scaled"
    shutil.copytree(trained_llama_dir, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor(0.5)
    weights["model.layers.1.self_attn.k_scale"] = torch.tensor([0.125, 2.0])
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor([1.0, 0.25])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    backend = select_backend("cpu", torch.device("cpu"))
    scaled, config = load_model(folder, torch.float32, attention=backend)
    plain, _ = load_model(trained_llama_dir, torch.float32, attention=backend)
    tokens = list(range(5, 45))
    sessions = {}
    for name, model, dtype in (("scaled", scaled, FP8), ("fp32", plain, torch.float32)):
        session = PagedSession(model, config, block_size=4, dtype=dtype)
        table = session.allocate(len(tokens) + 1)
        session.step([(tokens, 0, len(tokens), table)])
        sessions[name] = (session, table)
    (s8, table), (s32, _) = sessions["scaled"], sessions["fp32"]
    k8, k32 = s8.cache.data[table][:, :, 0], s32.cache.data[table][:, :, 0]
    scales = {0: torch.tensor([0.25, 0.25]), 1: torch.tensor([0.125, 2.0])}
    for layer, scale in scales.items():
        want = (k32[:, layer] / scale[:, None]).to(FP8).float()
        torch.testing.assert_close(k8[:, layer].float(), want, atol=0, rtol=0)
    logits8 = s8.step([(tokens + [7], len(tokens), 1, table)])[0]
    logits32 = s32.step([(tokens + [7], len(tokens), 1, table)])[0]
    assert float((logits8 - logits32).abs().max()) < 0.05 * float(logits32.abs().max())
    assert int(logits8.argmax()) == int(logits32.argmax())
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor([1.0, 0.25, 3.0])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="one per KV head"):
        load_model(folder, torch.float32, attention=backend)
