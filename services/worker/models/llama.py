"""Llama-family decoder (llama, mistral, qwen2, qwen3) running over the paged KV cache.

One implementation covers the family's variations, all read from `ModelConfig`: grouped-query
attention, q/k/v biases (qwen2; llama's `attention_bias` also biases o_proj), per-head RMSNorm
of queries and keys before RoPE (qwen3), and tied input/output embeddings. Module and
parameter names equal Hugging Face's, so an HF state dict loads without renaming.

`forward` takes a flat varlen batch of new tokens; each attention layer writes their K/V into
the cache and attends through the block tables with the `AttentionBackend` the model was
built with (plain torch or Triton).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.model_config import ModelConfig
from services.worker.kv_cache import KvCache
from services.worker.models.attention_backend import AttentionBackend, TorchAttention
from services.worker.models.attention_metadata import AttentionMetadata
from services.worker.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = config.attention_bias
        o_bias = config.attention_bias and config.architecture != "qwen2"
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, q_size, bias=qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv_size, bias=qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv_size, bias=qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(q_size, hidden, bias=o_bias, dtype=dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        else:
            self.q_norm = None
            self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = rotary(positions, q, k)
        k_cache, v_cache = cache
        self.backend.write_kv(k, v, k_cache, v_cache, meta)
        out = self.backend.attend(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inner, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inner, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(config, dtype, backend)
        self.mlp = MLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), positions, rotary, cache, meta
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    """Embeddings, decoder stack and final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            dict(config.rope_scaling) if config.rope_scaling is not None else None,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KvCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, positions, self.rotary_emb, kv_cache.layer(index), meta)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; `forward` returns hidden states, `compute_logits` the logits."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        attention: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.attention = attention or TorchAttention()
        self.model = LlamaModel(config, dtype, self.attention)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config asks for it."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KvCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Flat new tokens `[T]` at `positions` `[T]` -> final hidden states `[T, hidden]`."""
        self._check_cache(kv_cache, meta)
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(
                f"input_ids and positions must both be [T], got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        return self.model(input_ids, positions, kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, hidden]` -> float32 logits `[N, vocab]`."""
        return self.lm_head(hidden).float()

    def _check_cache(self, kv_cache: KvCache, meta: AttentionMetadata) -> None:
        config = self.config
        expected = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        actual = (kv_cache.num_layers, kv_cache.num_kv_heads, kv_cache.head_dim)
        if actual != expected:
            raise ValueError(
                f"KV cache geometry (layers, kv_heads, head_dim)={actual} does not match "
                f"the model's {expected}"
            )
        if meta.block_size != kv_cache.block_size:
            raise ValueError(
                f"metadata block_size {meta.block_size} != cache block_size {kv_cache.block_size}"
            )
