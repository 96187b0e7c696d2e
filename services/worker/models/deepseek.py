"""DeepSeek-V2 / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`) over the paged KV cache:
multi-head latent attention (MLA) and DeepSeek's experts, built from `llama.py`'s decoder
stack (same embedding, norms, residual layout, LM head, pipeline stages, loader and HF
parameter names). What this module owns:

- `MlaAttention`: queries through `q_proj`, or `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`;
  the token's latent `c = kv_a_layernorm(kv_a_proj_with_mqa(x)[:r])` and its shared key
  part `k_rope` (the rest, rotated). The cache holds only the entry `[c, k_rope]`
  (`common.mla_config`: `kv_lora_rank + qk_rope_head_dim` values per token and layer, laid
  entry after entry across the pool's K and V halves of a single KV head). Attention runs in
  the absorbed form, prompts and decodes alike: each head's no-RoPE query goes through
  W_UK (its rows of `kv_b_proj`) into latent space, so its score against a cached entry is
  `q_latent . c + q_rope . k_rope`, i.e. one query `[q_latent, q_rope]` against the entry:
  multi-query attention with a single KV head of `latent_dim` values, which every
  attention backend already computes in place over the paged cache (the C++ decode kernel,
  SDPA for prompt chunks, the torch reference, Triton). The entry is the value too: the
  weighted sum's first `kv_lora_rank` values are the latent output, which W_UV (the rest
  of `kv_b_proj`) lifts to each head's `v_head_dim`, then `o_proj`. (The weighted sum also
  runs over the `qk_rope_head_dim` key values, ~11% more of it at DeepSeek-V3's sizes,
  and drops them.) Scale: DeepSeek's `softmax_scale` (with yarn's mscale).
- the RoPE part's layouts: V3's `rope_interleave` (transformers'
  `apply_rotary_pos_emb_interleave`), `rotate_half`, and V2's complex product in float32.
- `DeepseekDecoderLayer`: MLA, then the dense MLP (the first `first_k_dense_replace`
  layers) or `moe.SharedExpertMoeBlock` (routed experts behind DeepSeek's router plus the
  shared experts).

The up-projections are mathematically HF's (which expands every cached latent into full
keys and values); the products are grouped differently, so results equal HF's to float
rounding. Tensor parallelism splits the heads (`sharding/mla_shards.py`); not done here:
LoRA and fp8 KV scales (refused at start).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from common.mla_config import COMPLEX, INTERLEAVE
from common.model_config import ModelConfig
from services.worker.models.attention_backend import AttentionBackend
from services.worker.models.attention_metadata import AttentionMetadata
from services.worker.models.linear import MergedLinear
from services.worker.models.llama import MLP, DecoderLayer, LlamaForCausalLM, LlamaModel
from services.worker.models.moe import SharedExpertMoeBlock
from services.worker.models.rms_norm import RMSNorm
from services.worker.models.rope import rotate
from services.worker.sharding.mla_shards import shared_inner
from services.worker.sharding.pipeline_stage import PipelineStage
from services.worker.sharding.tp_group import TpGroup, TpShard

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with its default


def rotate_interleaved(x: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb_interleave`: pairs (x0, x1), (x2, x3), ... each
    rotated by one frequency, the result laid out evens then odds."""
    cos, sin = tables
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate_complex(x: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """DeepSeek-V2's `apply_rotary_emb`: pairs as complex numbers times cos + i sin, in
    float32 (`tables` float32), the result cast back to `x`'s dtype."""
    cos, sin = tables
    pairs = torch.view_as_complex(x.float().contiguous().view(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2)
    return rotated.to(x.dtype)


def latent_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """One layer's cached entries `[num_blocks, block_size, 1, latent_dim]` from its K and V
    views (`KvCache.layer`: `[num_blocks, block_size, 1, latent_dim / 2]` each, V's right
    after K's in every block): the same memory, entry after entry."""
    blocks, block_size, heads, half = k_cache.shape
    if heads != 1 or k_cache.stride()[1:] != (half, half, 1) or v_cache.shape != k_cache.shape:
        raise ValueError(f"an MLA layer needs one contiguous latent head, got {k_cache.shape}")
    offset = v_cache.data_ptr() - k_cache.data_ptr()
    if offset != block_size * half * k_cache.element_size() or v_cache.stride() != k_cache.stride():
        raise ValueError("an MLA layer's K and V halves must be adjacent in every block")
    dim = 2 * half
    return torch.as_strided(k_cache, (blocks, block_size, 1, dim), (k_cache.stride(0), dim, dim, 1))


class MlaAttention(nn.Module):
    """Multi-head latent attention over the paged cache, absorbed (module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        shard: TpShard,
        tp: TpGroup,
        window: int | None = None,
    ) -> None:
        super().__init__()
        if window is not None:
            raise ValueError("latent attention has no sliding window")
        mla = config.mla
        self.backend, self.tp, self.mla = backend, tp, mla
        self.num_heads = heads = len(shard.q_heads)
        self.scale = mla.softmax_scale
        self.window: int | None = None
        self.kv_scales = None  # (fp8 KV scales are refused for MLA by the loader)
        hidden, rank, bias = config.hidden_size, mla.kv_lora_rank, config.attention_bias
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * mla.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = nn.Linear(
                mla.q_lora_rank, heads * mla.qk_head_dim, bias=False, dtype=dtype
            )
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = nn.Linear(
            rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False, dtype=dtype
        )
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=bias, dtype=dtype)
        self.rotate = {INTERLEAVE: rotate_interleaved, COMPLEX: rotate_complex}.get(
            mla.rope_layout, rotate
        )
        self.a_proj: MergedLinear | None = None  # queries' first product + kv_a, merged
        self.w_uk: torch.Tensor | None = None  # [heads, qk_nope_head_dim, kv_lora_rank]
        self.w_uv_t: torch.Tensor | None = None  # [heads, kv_lora_rank, v_head_dim]

    def merge_projections(self) -> None:
        """After loading: the two products that read the hidden state as one (when both or
        neither have biases), the others laid out for the device, and kv_b_proj split into
        the absorbed W_UK and W_UV."""
        first = self.q_proj if self.q_proj is not None else self.q_a_proj
        if (first.bias is None) == (self.kv_a_proj_with_mqa.bias is None):
            self.a_proj = MergedLinear.merge([first, self.kv_a_proj_with_mqa])
        else:
            self.a_proj = None
            if self.q_proj is not None:
                self.q_proj = MergedLinear.merge([self.q_proj])
            self.kv_a_proj_with_mqa = MergedLinear.merge([self.kv_a_proj_with_mqa])
        if self.q_b_proj is not None:
            self.q_b_proj = MergedLinear.merge([self.q_b_proj])
        self.o_proj = MergedLinear.merge([self.o_proj])
        mla = self.mla
        kv_b = self.kv_b_proj.weight.detach()
        kv_b = kv_b.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, -1)
        self.w_uk = kv_b[:, : mla.qk_nope_head_dim].contiguous()
        self.w_uv_t = kv_b[:, mla.qk_nope_head_dim :].transpose(1, 2).contiguous()
        del self.kv_b_proj

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries `[T, heads * qk_head_dim]`, kv_a output `[T, latent_dim]`)."""
        if self.a_proj is not None:
            q, kv = self.a_proj.split(hidden)
        else:  # (only q_proj without a bias beside a biased kv_a_proj_with_mqa)
            q, kv = self.q_proj(hidden), self.kv_a_proj_with_mqa(hidden)
        if self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(q.contiguous()))
        return q, kv

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, ...],
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        mla, heads, num_tokens = self.mla, self.num_heads, hidden.shape[0]
        rank = mla.kv_lora_rank
        q, kv = self._project(hidden)
        q = q.view(num_tokens, heads, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(kv[:, :rank].contiguous())
        k_rope = self.rotate(kv[:, rank:].view(num_tokens, 1, -1), rope)
        q_rope = self.rotate(q_rope, rope)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        query = torch.cat([q_latent, q_rope], dim=-1)  # [T, heads, latent_dim]
        entry = torch.cat([latent.unsqueeze(1), k_rope], dim=-1)  # [T, 1, latent_dim]
        entries = latent_cache(*cache)
        out = self.backend.forward(query, entry, entry, entries, entries, meta, self.scale)
        values = torch.bmm(out[..., :rank].transpose(0, 1), self.w_uv_t)  # [heads, T, v]
        flat = values.transpose(0, 1).reshape(num_tokens, heads * mla.v_head_dim)
        return self.tp.all_reduce(self.o_proj(flat))


class DeepseekDecoderLayer(DecoderLayer):
    """Llama's layer (norm, attention, residual, norm, MLP, residual) with MLA, and
    DeepSeek's experts in the layers from `first_k_dense_replace` on."""

    attention_class = MlaAttention

    def make_mlp(self, config, dtype, shard, tp, layer) -> nn.Module:
        moe = config.moe
        if moe is None or not config.is_moe_layer(layer):
            return MLP(config, dtype, shard, tp)
        shared = None
        if moe.shared_intermediate_size:
            inner = shared_inner(config, shard)
            shared = MLP(config, dtype, dataclasses.replace(shard, inner=inner), tp)
        return SharedExpertMoeBlock(
            config.hidden_size, moe, len(shard.expert_inner), dtype, tp,
            experts=shard.experts, shared_experts=shared,
        )  # fmt: skip


class Float32Rope(nn.Module):
    """The model's RoPE tables in float32 whatever the activations' dtype (DeepSeek-V2
    rotates in float32 with complex64 frequencies)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def tables(self, positions, dtype, rope_lengths=None):
        return self.inner.tables(positions, torch.float32, rope_lengths)


class DeepseekModel(LlamaModel):
    """Llama's decoder stack with DeepSeek's layers; RoPE over `qk_rope_head_dim`."""

    layer_class = DeepseekDecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        shard: TpShard,
        tp: TpGroup,
        stage: PipelineStage,
    ) -> None:
        super().__init__(config, dtype, backend, shard, tp, stage)
        if config.mla.rope_layout == COMPLEX:
            self.rotary_emb = Float32Rope(self.rotary_emb)


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepSeek decoder plus LM head."""

    model_class = DeepseekModel
