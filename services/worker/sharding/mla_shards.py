"""One tensor-parallel rank's slice of a DeepSeek-V2 / V3 checkpoint weight where it differs
from the dense rules of `weight_shards.py` (which handle the experts, the router, the dense
MLP, the embedding, the LM head and the norms).

Latent attention splits by query head: the rank keeps the rows of its heads in `q_proj` /
`q_b_proj` (`qk_head_dim` each) and `kv_b_proj` (`qk_nope_head_dim + v_head_dim` each,
so its W_UK and W_UV), and `o_proj`'s columns of its heads (`v_head_dim` each; a bias on
rank 0 only, as the dense o_proj's). `q_a_proj` and `kv_a_proj_with_mqa` stay whole: every
rank computes and caches the whole latent, the model's single KV head, which
`common.parallel_plan` replicates on every rank when tensor_parallel_size > 1 (so KV
transfers between layouts copy it from any rank). The shared experts split their inner
dimension like a dense MLP (`shared_inner`).
"""

from __future__ import annotations

import torch

from common.model_config import ModelConfig
from services.worker.sharding.tp_group import TpShard


def shared_inner(config: ModelConfig, shard: TpShard) -> range:
    """The rank's slice of DeepSeek's shared experts' inner dimension."""
    size = config.moe.shared_intermediate_size
    if size % shard.size:
        raise ValueError(
            f"tensor_parallel_size {shard.size} must divide the shared experts' intermediate "
            f"size {size}"
        )
    per = size // shard.size
    return range(shard.rank * per, (shard.rank + 1) * per)


def mla_slice(name: str, tensor: torch.Tensor, config: ModelConfig, shard: TpShard):
    """Rank `shard.rank`'s part of DeepSeek weight `name` (a view), or None where the dense
    rules apply."""
    mla = config.mla
    module, kind = name.rsplit(".", 2)[-2:]
    heads = shard.q_heads
    if module in ("q_proj", "q_b_proj"):
        return tensor[heads.start * mla.qk_head_dim : heads.stop * mla.qk_head_dim]
    if module == "kv_b_proj":
        per = mla.qk_nope_head_dim + mla.v_head_dim
        return tensor[heads.start * per : heads.stop * per]
    if module == "o_proj":
        if kind == "bias":
            return tensor if shard.rank == 0 else torch.zeros_like(tensor)
        return tensor[:, heads.start * mla.v_head_dim : heads.stop * mla.v_head_dim]
    if module in ("q_a_proj", "kv_a_proj_with_mqa"):
        return tensor
    if ".shared_experts." in name and module in ("gate_proj", "up_proj"):
        span = shared_inner(config, shard)
        return tensor[span.start : span.stop]
    if ".shared_experts." in name and module == "down_proj":
        span = shared_inner(config, shard)
        return tensor[:, span.start : span.stop]
    return None
