"""The draft-model proposer on the real tiny checkpoint, with HF `transformers` as the
reference: its proposals are the draft's greedy continuation (the whole model, or its first
layer: HF's model built with `num_hidden_layers=1`), batched over requests of different
lengths and k; after a step that rejected some proposals or accepted all of them, the next
proposals are again HF's continuation of the final tokens (the stale draft KV was redone);
a replaced block table lowers the draft's progress to the first changed block."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.sampling import SamplingParams
from common.step_plan import CachedRequestData, NewRequestData
from services.worker.batch import PersistentBatch
from services.worker.kv_cache import KvCache
from services.worker.models.weight_loader import load_model
from services.worker.spec_decode.draft_model_proposer import DraftModelProposer

BLOCK = 4
NUM_BLOCKS = 64


@functools.lru_cache(maxsize=4)
def hf_draft(folder: str, layers: int | None):
    extra = {} if layers is None else {"num_hidden_layers": layers}
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", **extra
    )
    return model.eval()


@torch.inference_mode()
def hf_continuation(folder, layers, tokens: list[int], n: int) -> list[int]:
    model = hf_draft(str(folder), layers)
    ids = torch.tensor([tokens])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
        min_new_tokens=n, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(tokens) :].tolist()


def proposer(folder, layers):
    model, config = load_model(folder, torch.float32, num_layers=layers)
    cache = KvCache(
        NUM_BLOCKS, BLOCK, config.num_hidden_layers, config.num_key_value_heads,
        config.head_dim, torch.float32,
    )  # fmt: skip
    return DraftModelProposer(model, cache, torch.device("cpu")), config


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (13, 5)]


def batch_with(config, token_lists) -> tuple[PersistentBatch, list]:
    batch = PersistentBatch(BLOCK, NUM_BLOCKS, config.vocab_size)
    per = NUM_BLOCKS // len(token_lists)
    new = [
        NewRequestData(f"r{i}", t, list(range(i * per, (i + 1) * per)), 0, len(t), SamplingParams())
        for i, t in enumerate(token_lists)
    ]
    return batch, batch.apply([], new, [])


@pytest.mark.parametrize("layers", [None, 1], ids=["whole", "first-layer"])
def test_proposals_are_the_drafts_greedy_continuation_and_survive_rollback(tiny_llama_dir, layers):
    draft, config = proposer(tiny_llama_dir, layers)
    batch, work = batch_with(config, prompts(config.vocab_size))
    ks = [4, 2]
    proposals = draft.propose_batch([(w.request, k) for w, k in zip(work, ks, strict=True)])
    for w, k, got in zip(work, ks, proposals, strict=True):
        assert got == hf_continuation(tiny_llama_dir, layers, w.request.token_ids, k)
    # r0: its first proposal accepted, then a token the draft did not propose; r1: both
    # accepted, then the bonus token.
    bonus0 = (proposals[0][1] + 1) % config.vocab_size
    bonus1 = hf_continuation(tiny_llama_dir, layers, work[1].request.token_ids, 3)[2]
    batch.complete(work, {"r0": bonus0, "r1": bonus1}, {"r0": proposals[0][:1], "r1": proposals[1]})
    assert [w.request.num_draft_computed_tokens for w in work] == [
        len(work[0].request.token_ids) - 1,  # through the accepted proposal
        len(work[1].request.token_ids) - 2,  # all but the last proposal's KV
    ]
    work = batch.apply([], [], [CachedRequestData(f"r{i}", [], 1) for i in range(2)])
    proposals = draft.propose_batch([(w.request, 3) for w in work])
    for w, got in zip(work, proposals, strict=True):
        assert got == hf_continuation(tiny_llama_dir, layers, w.request.token_ids, 3)


def test_a_replaced_block_table_redoes_the_draft_from_the_first_changed_block(tiny_llama_dir):
    draft, config = proposer(tiny_llama_dir, 1)
    tokens = prompts(config.vocab_size)[0]
    batch, work = batch_with(config, [tokens])
    draft.propose_batch([(work[0].request, 2)])
    assert work[0].request.num_draft_computed_tokens == len(tokens) + 1
    table = list(work[0].request.block_ids)
    table[2] = NUM_BLOCKS - 1 if table[2] != NUM_BLOCKS - 1 else 0  # a copied block
    batch.complete(work, {"r0": 5}, {})
    batch.apply([], [], [CachedRequestData("r0", [], 1, block_table=table)])
    assert work[0].request.num_draft_computed_tokens == 2 * BLOCK


def test_a_truncated_load_reads_only_the_first_layers(tiny_llama_dir):
    model, config = load_model(tiny_llama_dir, torch.float32, num_layers=1)
    assert config.num_hidden_layers == 1 and len(model.model.layers) == 1
    with pytest.raises(ValueError, match="num_layers must be in"):
        load_model(tiny_llama_dir, torch.float32, num_layers=99)
