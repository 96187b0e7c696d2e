"""Gemma 2 and Gemma 3 text (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`) over the paged KV
cache, built from `llama.py`'s pieces: the same merged projections, attention backends,
tensor and pipeline parallelism, weight names and loader. What this module owns is where
Gemma departs from Llama (`common.gemma_config.GemmaConfig` holds the settings):

- `GemmaRMSNorm`: x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32, then cast (the
  gain 1 + w is computed once after loading, `fold`);
- `GemmaMLP`: GeGLU, down(gelu_tanh(gate(x)) * up(x));
- `GemmaAttention`: scale `query_pre_attn_scalar ** -0.5`, Gemma 2's tanh soft-cap of the
  scores (every attention backend takes it: `attention_backend.py`), Gemma 3's q/k norms
  (as `GemmaRMSNorm`);
- `GemmaDecoderLayer`: norms before and after both attention and MLP (four per layer);
- `GemmaModel`: the embedding times sqrt(hidden_size) (rounded to the model's dtype, as
  transformers rounds it), and Gemma 3's two RoPEs (`LayerTypeRope`: its sliding
  layers rotate with the local one);
- `GemmaForCausalLM`: the final logits' tanh soft-cap.

Sliding windows come from `ModelConfig.sliding_window(layer)` like every other family's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.model_config import ModelConfig
from services.worker.models.attention_backend import AttentionBackend
from services.worker.models.attention_metadata import AttentionMetadata
from services.worker.models.gpt_oss import GptOssForCausalLM
from services.worker.models.llama import (
    MLP,
    Attention,
    DecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
from services.worker.models.rms_norm import RMSNorm, _kernel_fits
from services.worker.models.rope import RotaryEmbedding
from services.worker.sharding.pipeline_stage import PipelineStage
from services.worker.sharding.tp_group import TpGroup, TpShard


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is an offset from 1 (HF stores w, scales by 1 + w)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(size, eps, dtype)
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype))
        self.gain: torch.Tensor | None = None  # float32 1 + weight, once loaded (`fold`)

    def fold(self) -> None:
        """Compute the float32 gain from the loaded weight (idempotent)."""
        self.gain = 1.0 + self.weight.detach().float()

    def _gain(self) -> torch.Tensor:
        return self.gain if self.gain is not None else 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gain = self._gain()
        if _kernel_fits(x, gain):  # float32 CPU: the C++ kernel, the gain as its weight
            return torch.ops.tandem_cpu.rms_norm(x, gain, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * gain).to(x.dtype)

    def add_forward(
        self, residual: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, this norm of it)."""
        gain = self._gain()
        if (
            _kernel_fits(x, gain)
            and residual.dtype == torch.float32
            and residual.is_contiguous()
            and residual.shape == x.shape
        ):
            return torch.ops.tandem_cpu.add_rms_norm(residual, x, gain, self.eps)
        total = residual + x
        return total, self(total)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gate_up` [..., 2I] (gate, then up) -> gelu_tanh(gate) * up [..., I] (GeGLU with
    transformers' `gelu_pytorch_tanh`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GemmaMLP(MLP):
    """GeGLU feed-forward: down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x))))


class GemmaAttention(Attention):
    """Llama's attention with Gemma's scale, score soft-cap and (1 + w) q/k norms."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        shard: TpShard,
        tp: TpGroup,
        window: int | None = None,
    ) -> None:
        super().__init__(config, dtype, backend, shard, tp, window)
        self.scale = config.gemma.attention_scale
        self.softcap = config.gemma.attn_logit_softcapping
        if config.qk_norm:  # Gemma 3
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)


class GemmaDecoderLayer(DecoderLayer):
    """x + post_ff(mlp(pre_ff(h))) where h = x + post_attn(attn(input(x)))."""

    attention_class = GemmaAttention
    norm_class = GemmaRMSNorm

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        shard: TpShard,
        tp: TpGroup,
        layer: int,
    ) -> None:
        super().__init__(config, dtype, backend, shard, tp, layer)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.local_rope = config.gemma.local_rope(layer)

    def make_mlp(self, config, dtype, shard, tp, layer) -> nn.Module:
        return GemmaMLP(config, dtype, shard, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """`rope`: (the full layers' tables, the sliding layers') from `LayerTypeRope`."""
        attended = self.self_attn(self.input_layernorm(hidden), rope[self.local_rope], cache, meta)
        attended = self.post_attention_layernorm(attended)
        hidden, normed = self.pre_feedforward_layernorm.add_forward(hidden, attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(normed))


class LayerTypeRope(nn.Module):
    """The model's RoPE tables per layer type: `tables` gives (full, local) once per pass
    (the same tables twice when the sliding layers rotate like the others: Gemma 2)."""

    def __init__(self, full: RotaryEmbedding, local: RotaryEmbedding | None) -> None:
        super().__init__()
        self.full, self.local = full, local

    def tables(self, positions, dtype, rope_lengths=None):
        full = self.full.tables(positions, dtype, rope_lengths)
        if self.local is None:
            return full, full
        return full, self.local.tables(positions, dtype, rope_lengths)


class GemmaModel(LlamaModel):
    """Llama's decoder stack with Gemma's layers, norm, embedding scale and RoPEs."""

    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

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
        gemma = config.gemma
        local = None
        if any(layer.local_rope for layer in self.layers):
            scaling = gemma.local_rope_scaling
            local = RotaryEmbedding(
                config.head_dim,
                config.max_position_embeddings,
                gemma.local_rope_theta,
                dict(scaling) if scaling is not None else None,
            )
        self.rotary_emb = LayerTypeRope(self.rotary_emb, local)
        # sqrt(hidden_size) rounded as transformers rounds it (a float32 tensor cast to the
        # model's dtype: 55.5 for 55.4256 in bfloat16); a Python number (no device tensor
        # to copy, so CUDA graphs capture it) multiplies exactly as that 0-d tensor would.
        root = torch.tensor(config.hidden_size**0.5, dtype=torch.float32, device="cpu")
        self.embed_scale = float(root.to(dtype))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super()._embed(input_ids) * self.embed_scale


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma decoder plus LM head; `compute_logits` soft-caps the logits."""

    model_class = GemmaModel

    def merge_projections(self) -> None:
        """Llama's merge, then each norm's gain (also after a quantized load, which merges
        the projections itself)."""
        super().merge_projections()
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.fold()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.gemma.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


def causal_lm_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The model class for `config`'s architecture (gpt-oss's: `gpt_oss.py`)."""
    if config.gpt_oss is not None:
        return GptOssForCausalLM
    return GemmaForCausalLM if config.gemma is not None else LlamaForCausalLM
