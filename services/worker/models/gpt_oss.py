"""OpenAI's gpt-oss (`GptOssForCausalLM`) over the paged KV cache, built from `llama.py`'s
pieces (merged projections, attention backends, tensor and pipeline parallelism, loader) and
`moe.py`'s experts. What this module owns is where gpt-oss departs from them
(`common.gpt_oss_config` parses the settings):

- `GptOssAttention`: Llama's attention (q/k/v/o biases, grouped-query heads, a sliding window
  on the "sliding_attention" layers) with `sinks`, one learned logit per query head whose
  exp joins that head's softmax denominator (every attention backend takes them:
  `attention_backend.py`);
- `GptOssMoeBlock`: the router `mlp.router` (a biased linear layer) picks each token's top k
  experts by logit and weights them by a softmax over those k logits; the experts
  (`moe.Experts`, grouped products over the batch, tensor or expert parallel like the other
  MoE families) have biases and apply `moe.ClampedSwiGLU`;
- `GptOssRMSNorm`: transformers keeps gpt-oss's norm weights in float32 and scales the
  float32 normalised states before casting (the same as Llama's norm in float32);
- `GptOssModel`, `GptOssForCausalLM`: Llama's stack and head with these layers.

The checkpoint's experts are turned into `moe.Experts`' layout (and MXFP4 ones dequantized)
by `gpt_oss_weights.py`. RoPE is the llama family's (YaRN in every gpt-oss checkpoint).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.model_config import ModelConfig
from services.worker.models.attention_backend import AttentionBackend
from services.worker.models.llama import Attention, DecoderLayer, LlamaForCausalLM, LlamaModel
from services.worker.models.moe import ClampedSwiGLU, Experts
from services.worker.models.rms_norm import RMSNorm
from services.worker.sharding.tp_group import TpGroup, TpShard


class GptOssRMSNorm(RMSNorm):
    """RMSNorm with transformers' gpt-oss order off float32: weight (float32) times the
    float32 normalised states, then the cast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class GptOssAttention(Attention):
    """Llama's attention with per-head sink logits (this rank's query heads)."""

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
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), requires_grad=False)


class GptOssMoeBlock(nn.Module):
    """Router plus experts: HF's `GptOssMLP` over a flat `[T, hidden]` batch. `inner`: this
    rank's slice of each expert's inner size; `experts`: the experts this rank holds."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        tp: TpGroup,
        inner: int,
        experts: range,
    ) -> None:
        super().__init__()
        moe, swiglu = config.moe, config.gpt_oss
        self.tp, self.top_k = tp, moe.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, moe.num_experts, bias=True, dtype=dtype)
        first = None if len(experts) == moe.num_experts else experts.start
        activation = ClampedSwiGLU(swiglu.swiglu_alpha, swiglu.swiglu_limit)
        self.experts = Experts(
            len(experts), config.hidden_size, inner, dtype, first, bias=True,
            activation=activation,
        )  # fmt: skip

    def merge_projections(self) -> None:
        self.experts.merge_projections()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.weight, self.router.bias)
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top, dim=1, dtype=top.dtype)
        return self.tp.all_reduce(self.experts(x, weights, experts))


class GptOssDecoderLayer(DecoderLayer):
    """x + moe(post_norm(h)) where h = x + attn(input_norm(x)): Llama's layer with gpt-oss's
    attention (sinks), norm and experts."""

    attention_class = GptOssAttention
    norm_class = GptOssRMSNorm

    def make_mlp(self, config, dtype, shard, tp, layer) -> nn.Module:
        return GptOssMoeBlock(config, dtype, tp, len(shard.expert_inner), shard.experts)


class GptOssModel(LlamaModel):
    """Llama's decoder stack with gpt-oss's layers and norm."""

    layer_class = GptOssDecoderLayer
    norm_class = GptOssRMSNorm


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss decoder plus LM head."""

    model_class = GptOssModel
