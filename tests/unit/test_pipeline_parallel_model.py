"""The pipeline-parallel model on real `torch.distributed` (gloo, one process per rank):
each stage loads only its layers (and the embedding / final norm and LM head where it
needs them), keeps only its layers' KV in its own paged cache, hands its hidden states to
the next stage point to point, and the last stage's greedy tokens over a prefill and decode
steps are HF's. Layouts: 2 stages, 3 uneven stages of a tied-embedding model, 2 stages
of 2 tensor ranks each, and 2 stages of Qwen3-MoE (its dense layer 0, its sparse layer 1)."""

from __future__ import annotations

import pytest
import torch

from devtools.checkpoint_builder import build_checkpoint
from tests.hf_reference import hf_greedy, hf_model
from tests.rank_group import run_ranks

NEW_TOKENS = 6


def _rank_main(rank, tp, pp, folder, store, prompt, out):
    import torch.distributed as dist

    from common.model_config import ModelConfig
    from common.parallel_plan import Layout
    from services.worker.kv_cache import KvCache
    from services.worker.micro_batches import pipelined_forward
    from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata
    from services.worker.models.weight_loader import load_model
    from services.worker.sharding.pipeline_stage import PipelineStage
    from services.worker.sharding.tp_group import TpGroup

    torch.set_num_threads(1)
    layout = Layout(tp, pp)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=layout.world_size
    )
    try:
        groups = [dist.new_group([layout.rank(s, r) for r in range(tp)]) for s in range(pp)]
        num_layers = ModelConfig.from_folder(folder).num_hidden_layers
        stage = PipelineStage.of(layout, rank, num_layers)
        tp_group = TpGroup(rank % tp, tp, groups[stage.stage] if tp > 1 else None)
        sampler = layout.rank(pp - 1, 0)
        with torch.inference_mode():
            model, config = load_model(folder, torch.float32, tp=tp_group, stage=stage)
            cache = KvCache(16, 4, len(stage.layers), len(model.shard.kv_heads),
                            config.head_dim, torch.float32)  # fmt: skip
            # Two copies of the prompt as two sequences, run as two micro-batches; both must
            # follow HF. The first starts from a prefix-cache hit on block 0, which the second
            # writes in the same step (a later micro-batch): that step must run as one.
            seqs = [list(prompt), list(prompt)]
            tables = [[0, *range(9, 16)], list(range(8))]
            computed = [4, 0]
            for _ in range(NEW_TOKENS):
                todo = [s[c:] for s, c in zip(seqs, computed, strict=True)]
                slices = [
                    SequenceSlice(c, len(t), b)
                    for c, t, b in zip(computed, todo, tables, strict=True)
                ]
                ids = torch.tensor([t for part in todo for t in part])
                positions, meta = build_attention_metadata(slices, 4, torch.device("cpu"))
                hidden = pipelined_forward(model, ids, positions, meta, slices, cache)
                assert (hidden is None) == (not stage.is_last)
                if stage.is_first and pp > 1:  # one send per micro-batch, all waited for
                    assert not stage._sending
                next_ids = torch.zeros(2, dtype=torch.int64)
                if hidden is not None:
                    last_rows = torch.tensor(meta.query_start_loc[1:]) - 1
                    next_ids[:] = model.compute_logits(hidden[last_rows]).argmax(-1)
                dist.broadcast(next_ids, src=sampler)
                computed = [len(seqs[0]), len(seqs[1])]
                for s, t in zip(seqs, next_ids.tolist(), strict=True):
                    s.append(t)
            tokens = seqs[0] if seqs[0] == seqs[1] else None
            names = sorted(model.state_dict())
            params = sum(p.numel() for p in model.parameters())
            out.put((rank, tokens and tokens[len(prompt) :], names, params))
    finally:
        dist.destroy_process_group()


def run_group(folder, tp, pp, prompt, tmp_path):
    return run_ranks(_rank_main, tp * pp, (tp, pp, str(folder), tmp_path / "store", prompt))


@pytest.fixture(scope="module")
def tied_three_layer_dir(tmp_path_factory):
    return build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tied-3", "llama", num_hidden_layers=3,
        tie_word_embeddings=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("model", "tp", "pp", "stage_layers"),
    [
        ("tiny_llama_dir", 1, 2, [[0], [0]]),
        ("tied_three_layer_dir", 1, 3, [[0], [0], [0]]),
        ("tiny_llama_dir", 2, 2, [[0], [0], [0], [0]]),
        ("tiny_qwen3_moe_dir", 1, 2, [[0], [0]]),  # a dense stage, then a sparse one
    ],
    ids=["llama-pp2", "tied-3-layers-pp3", "llama-tp2-pp2", "qwen3_moe-pp2"],
)
def test_pipeline_stages_greedy_equals_hf(model, tp, pp, stage_layers, request, tmp_path):
    folder = request.getfixturevalue(model)
    prompt = [5, 17, 230, 9, 44, 101, 7]
    results = run_group(folder, tp, pp, prompt, tmp_path)
    want = hf_greedy(folder, prompt, NEW_TOKENS)
    full_params = sum(p.numel() for p in hf_model(str(folder)).parameters())
    for rank, tokens, names, params in results:
        stage = rank // tp
        assert tokens == want, rank
        layers = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})
        assert layers == stage_layers[rank], rank  # each stage numbers its layers from 0
        # A tied head is the embedding matrix, copied into the head's own layout: a last
        # stage then keeps the head, not the lookup table.
        assert ("model.embed_tokens.weight" in names) == (stage == 0), rank
        assert ("lm_head.weight" in names) == (stage == pp - 1), rank
        assert ("model.norm.weight" in names) == (stage == pp - 1), rank
        assert params < full_params * 0.75, rank  # its part of the model, not the whole
