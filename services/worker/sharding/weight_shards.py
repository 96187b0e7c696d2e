"""One tensor-parallel rank's slice of each checkpoint weight, by its Hugging Face name:
q/k/v rows of the rank's heads, o_proj columns of its query heads, gate/up rows and
down_proj columns of its inner slice (and of the stacked `experts.gate_up_proj` [E, 2I, H]
and `experts.down_proj` [E, H, I], the rank's experts, each's inner slice: every expert
and a slice of each, or with expert parallelism some experts whole; the router is whole),
embedding and LM-head rows of its vocabulary (padded with zero rows to the same count on
every rank); norms are whole on every rank. A row-parallel layer's bias (o_proj's in Llama
with attention_bias) is kept by rank 0 only: the all-reduce after the layer adds it once.
gpt-oss: the attention sinks of the rank's query heads; the experts' gate/up biases
[E, 2I] sliced like their rows; their down biases [E, H] whole where each rank holds whole
experts (expert parallelism), else on rank 0 only (zeros elsewhere), like o_proj's."""

from __future__ import annotations

import torch

from common.model_config import ModelConfig
from services.worker.sharding.mla_shards import mla_slice
from services.worker.sharding.tp_group import TpShard


def _rows(t: torch.Tensor, span: range, unit: int = 1) -> torch.Tensor:
    return t[span.start * unit : span.stop * unit]


def _cols(t: torch.Tensor, span: range, unit: int = 1) -> torch.Tensor:
    return t[:, span.start * unit : span.stop * unit]


def shard_weight(name: str, tensor: torch.Tensor, config: ModelConfig, shard: TpShard):
    """The part of `tensor` (checkpoint weight `name`) rank `shard.rank` holds: a copy, so
    the whole tensor can be freed."""
    if shard.size == 1:
        return tensor
    part = None if config.mla is None else mla_slice(name, tensor, config, shard)  # DeepSeek
    return (_slice(name, tensor, config, shard) if part is None else part).clone()


def _slice(name: str, tensor: torch.Tensor, config: ModelConfig, shard: TpShard):
    hd = config.head_dim
    leaf = name.rsplit(".", 2)[-2:]  # (module, weight|bias)
    module, kind = leaf[0], leaf[1]
    if module == "q_proj":
        return _rows(tensor, shard.q_heads, hd)
    if module in ("k_proj", "v_proj"):
        return _rows(tensor, shard.kv_heads, hd)
    if module == "self_attn" and kind == "sinks":  # one per query head
        return _rows(tensor, shard.q_heads)
    if module == "o_proj":
        if kind == "bias":
            return tensor if shard.rank == 0 else torch.zeros_like(tensor)
        return _cols(tensor, shard.q_heads, hd)
    if module in ("gate_proj", "up_proj"):
        return _rows(tensor, shard.inner)
    if module == "down_proj":
        return _cols(tensor, shard.inner)
    if module == "experts":  # this rank's experts, whole or not
        tensor = tensor[shard.experts.start : shard.experts.stop]
    if module == "experts" and kind == "gate_up_proj":  # [E, gate rows + up rows, H]
        gate, up = tensor.chunk(2, dim=1)
        return torch.cat([_cols(gate, shard.expert_inner), _cols(up, shard.expert_inner)], 1)
    if module == "experts" and kind == "down_proj":  # [E, H, I]
        span = shard.expert_inner
        return tensor[..., span.start : span.stop]
    if module == "experts" and kind == "gate_up_proj_bias":  # [E, gate + up]
        gate, up = tensor.chunk(2, dim=1)
        span = shard.expert_inner
        return torch.cat([gate[:, span.start : span.stop], up[:, span.start : span.stop]], 1)
    if module == "experts" and kind == "down_proj_bias":  # [E, H]
        split = len(shard.expert_inner) < config.moe.expert_intermediate_size
        return torch.zeros_like(tensor) if split and shard.rank != 0 else tensor
    if module in ("embed_tokens", "lm_head"):
        part = _rows(tensor, shard.vocab)
        missing = shard.vocab_per_rank - part.shape[0]
        if missing:
            part = torch.cat([part, part.new_zeros(missing, *part.shape[1:])])
        return part
    return tensor
