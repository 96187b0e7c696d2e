"""DeepSeek's latent attention on the Triton kernels (on CPU under the Triton interpreter, on a
GPU compiled): MLA attends as multi-query attention of every head over one cached entry of
kv_lora_rank + qk_rope_head_dim values that is both key and value, the K and V caches being
one view of the pool (`deepseek.latent_cache`). The decode and prefill kernels on that view
(a non-power-of-two entry, a 16-head group, NaN-poisoned unused slots) against the torch
reference; and a tiny DeepSeek-V3 (MoE) through the Triton backend equal to HF's logits and
greedy `generate`, and to the torch backend over an fp8 cache.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel definitions

import pytest  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from devtools.checkpoint_builder import build_checkpoint  # noqa: E402
from kernels import torch_paged  # noqa: E402
from kernels.paged_decode_attention import paged_decode_attention  # noqa: E402
from kernels.paged_prefill_attention import paged_prefill_attention  # noqa: E402
from services.worker.kv_cache import KvCache  # noqa: E402
from services.worker.models.attention_backend import select_backend  # noqa: E402
from services.worker.models.deepseek import latent_cache  # noqa: E402
from services.worker.models.weight_loader import load_model  # noqa: E402
from tests.unit.test_model_parity import PagedSession, random_tokens  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The model-level checks drive `PagedSession`, which keeps its cache and metadata on the CPU.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU session")
ENTRY, HEADS, BLOCK = 72, 16, 8  # 64 latent + 8 rope values; one program covers 16 heads


def _entries(seq_lens, gen):
    """A 2-layer pool poisoned with NaN, the written slots of layer 1 random; its entries
    view and shuffled block tables."""
    blocks = sum(-(-n // BLOCK) for n in seq_lens) + 3
    cache = KvCache(blocks, BLOCK, 2, 1, ENTRY // 2, torch.float32, DEVICE)
    cache.data.fill_(float("nan"))
    entries = latent_cache(*cache.layer(1))
    order = torch.randperm(blocks - 1, generator=gen) + 1  # block 0 pads the tables
    tables = torch.zeros(len(seq_lens), max(-(-n // BLOCK) for n in seq_lens), dtype=torch.int32)
    start = 0
    for i, n in enumerate(seq_lens):
        count = -(-n // BLOCK)
        tables[i, :count] = order[start : start + count]
        start += count
        flat = entries[tables[i, :count].long()].view(-1, ENTRY)
        flat[:n] = torch.randn(n, ENTRY, generator=gen).to(DEVICE)
        entries[tables[i, :count].long()] = flat.view(count, BLOCK, 1, ENTRY)
    return entries, tables.to(DEVICE)


def test_decode_kernel_on_the_latent_view_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    seq_lens = [1, 9, 30]
    entries, tables = _entries(seq_lens, gen)
    query = torch.randn(len(seq_lens), HEADS, ENTRY, generator=gen).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(query, entries, entries, tables, lens, 0.1, num_splits=2)
    starts = list(range(len(seq_lens) + 1))
    expected = torch_paged.paged_attention(query, entries, entries, tables, starts, seq_lens, 0.1)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_prefill_kernel_on_the_latent_view_matches_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    seq_lens, q_lens = [12, 20, 5], [12, 7, 1]  # a fresh prompt, a chunk after a prefix, one
    entries, tables = _entries(seq_lens, gen)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], HEADS, ENTRY, generator=gen).to(DEVICE)
    out = paged_prefill_attention(
        query, entries, entries, tables,
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), 0.1, max_query_len=12,
    )  # fmt: skip
    expected = torch_paged.paged_attention(query, entries, entries, tables, starts, seq_lens, 0.1)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("mla") / "v3", "deepseek_v3", seed=22)


@interpreter_only
@torch.inference_mode()
def test_deepseek_v3_on_the_triton_backend_equals_hf(v3) -> None:
    model, config = load_model(v3, torch.float32, DEVICE, select_backend("triton", DEVICE))
    hf = AutoModelForCausalLM.from_pretrained(v3, dtype=torch.float32).eval()
    tokens = random_tokens(config, 19, seed=5)
    expected = hf(torch.tensor([tokens])).logits[0].float()
    session = PagedSession(model, config, block_size=4)
    table = session.allocate(len(tokens))
    got = [session.step([(tokens, 0, 11, table)])[0]]
    got += [session.step([(tokens, p, 1, table)])[0] for p in range(11, 19)]
    torch.testing.assert_close(torch.cat(got).cpu(), expected, atol=1e-4, rtol=1e-4)


@interpreter_only
@torch.inference_mode()
def test_fp8_latent_cache_triton_matches_torch(v3) -> None:
    outs = {}
    for name in ("torch", "triton"):
        model, config = load_model(v3, torch.float32, DEVICE, select_backend(name, DEVICE))
        session = PagedSession(model, config, block_size=4, dtype=torch.float8_e4m3fn)
        tokens = random_tokens(config, 15, seed=6)
        table = session.allocate(len(tokens))
        outs[name] = [session.step([(tokens, 0, 9, table)])[0]]
        outs[name] += [session.step([(tokens, p, 1, table)])[0] for p in range(9, 15)]
    torch.testing.assert_close(torch.cat(outs["triton"]), torch.cat(outs["torch"]),
                               atol=1e-3, rtol=1e-3)  # fmt: skip
