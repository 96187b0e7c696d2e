"""The tensor-parallel model on real `torch.distributed` (gloo, one process per rank):
each rank loads only its slice of the checkpoint, keeps only its KV heads in its own paged
cache, and the group's greedy tokens over a prefill and decode steps are HF's; its logits
match HF's. TP=2 splits the KV heads, TP=4 replicates them (2 KV heads), on Llama, on
Qwen2 (q/k/v biases) and on the mixture-of-experts Mixtral and Qwen3-MoE (every expert's
inner dimension split, as the dense MLP's; or, with expert parallelism, the experts split
whole over the ranks, each rank computing only its own experts' assignments)."""

from __future__ import annotations

import pytest
import torch

from common.model_config import ModelConfig
from tests.hf_reference import hf_greedy, hf_log_softmax
from tests.rank_group import run_ranks

NEW_TOKENS = 6


def _rank_main(rank, size, folder, store, prompt, expert_parallel, out):
    import torch.distributed as dist

    from services.worker.kv_cache import KvCache
    from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata
    from services.worker.models.weight_loader import load_model
    from services.worker.sharding.tp_group import TpGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        with torch.inference_mode():
            tp = TpGroup(rank, size, expert_parallel=expert_parallel)
            model, config = load_model(folder, torch.float32, tp=tp)
            shard = model.shard
            cache = KvCache(8, 4, config.num_hidden_layers, len(shard.kv_heads),
                            config.head_dim, torch.float32)  # fmt: skip
            tokens, blocks, first_logits = list(prompt), list(range(8)), None
            computed = 0
            for _ in range(NEW_TOKENS):
                todo = tokens[computed:]
                positions, meta = build_attention_metadata(
                    [SequenceSlice(computed, len(todo), blocks)], 4, torch.device("cpu")
                )
                hidden = model(torch.tensor(todo), positions, cache, meta)
                logits = model.compute_logits(hidden[-1:])
                first_logits = logits[0] if first_logits is None else first_logits
                computed = len(tokens)
                tokens.append(int(logits.argmax(-1)))
            params = sum(p.numel() for p in model.parameters())
            experts = None
            if config.moe is not None:
                moe_layers = [lay.mlp for lay in model.model.layers if hasattr(lay.mlp, "experts")]
                held = moe_layers[0].experts.gate_up_proj
                experts = (shard.experts, tuple(held.shape))
            out.put((rank, tokens[len(prompt):], first_logits.tolist(), params,
                     len(shard.kv_heads), experts))  # fmt: skip
    finally:
        dist.destroy_process_group()


def run_group(folder, size, prompt, tmp_path, expert_parallel=False):
    args = (size, str(folder), tmp_path / "store", prompt, expert_parallel)
    return run_ranks(_rank_main, size, args)


@pytest.mark.parametrize(
    ("arch", "size", "ep"),
    [("llama", 2, False), ("llama", 4, False), ("qwen2", 2, False), ("mixtral", 2, False),
     ("qwen3_moe", 2, False), ("mixtral", 2, True), ("qwen3_moe", 2, True)],
    ids=["llama-tp2", "llama-tp4", "qwen2-tp2", "mixtral-tp2", "qwen3_moe-tp2", "mixtral-ep2",
         "qwen3_moe-ep2"],
)  # fmt: skip
def test_tensor_parallel_greedy_equals_hf(arch, size, ep, request, tmp_path):
    folder = request.getfixturevalue(f"tiny_{arch}_dir")
    prompt = [5, 17, 230, 9, 44, 101, 7]
    results = run_group(folder, size, prompt, tmp_path, expert_parallel=ep)
    want = hf_greedy(folder, prompt, NEW_TOKENS)
    reference = hf_log_softmax(folder, prompt)[-1]
    full_params = sum(p.numel() for p in __import__("tests.hf_reference").hf_reference.hf_model(
        str(folder)).parameters())  # fmt: skip
    for rank, tokens, logits, params, kv_heads, experts in results:
        assert tokens == want, rank
        got = torch.log_softmax(torch.tensor(logits), -1)
        assert torch.allclose(got, reference, atol=1e-4), rank
        assert params < full_params * 0.75  # a slice of the weights, not the whole model
        assert kv_heads == max(1, 2 // size)  # the model has 2 KV heads
        if experts is not None:
            held, shape = experts
            model_config = ModelConfig.from_folder(folder)
            count, inner = model_config.moe.num_experts, model_config.moe.expert_intermediate_size
            hidden = model_config.hidden_size  # gate/up: [experts, H, 2I'] on CPU
            if ep:  # half the experts, whole; rank r the r-th half
                assert held == range(rank * count // 2, (rank + 1) * count // 2)
                assert (shape[0], shape[1] * shape[2]) == (count // 2, hidden * 2 * inner)
            else:  # every expert, half of each
                assert held == range(count)
                assert (shape[0], shape[1] * shape[2]) == (count, hidden * inner)
