"""Llama-family decoder (llama, mistral, qwen2, qwen3, and the mixture-of-experts mixtral and
qwen3_moe) running over the paged KV cache.

One implementation covers the family's variations, all read from `ModelConfig`: grouped-query
attention, q/k/v biases (qwen2; llama's `attention_bias` also biases o_proj), per-head RMSNorm
of queries and keys before RoPE (qwen3, qwen3_moe), a sliding window in the layers that
`ModelConfig.sliding_window` names, tied input/output embeddings, and routed experts in
place of the dense MLP in the layers `ModelConfig.is_moe_layer` names
(`moe.SparseMoeBlock`). Module and parameter names equal Hugging Face's (v5's, for the
stacked experts), so an HF state dict loads without renaming.

`forward` takes a flat varlen batch of new tokens; each attention layer writes their K/V into
the cache and attends through the block tables with the `AttentionBackend` the model was
built with (SDPA, the plain-torch reference, or Triton).

Tensor parallelism (`tp`, a `TpGroup` of size > 1): the model holds one rank's slice
(`TpShard`): its query and KV heads (q/k/v column-parallel, o row-parallel), its slice of
the MLP's inner dimension (gate/up column-parallel, down row-parallel), and its rows of the
vocabulary (embedding and LM head). The row-parallel outputs and the embedding are summed
over the group (one all-reduce each), the logits gathered; a rank's KV cache holds its own
KV heads. Size 1 is the plain model.

Pipeline parallelism (`stage`, a `PipelineStage` of size > 1): the model holds its stage's
decoder layers only (HF's layer `i` is its layer `i - first`, and its KV cache holds those
layers); the first stage embeds the tokens, the others take the previous stage's hidden
states; the last stage ends with the final norm and the LM head (and keeps the embedding
when the two are tied), the others pass their hidden states on and `forward` returns None.
After loading, `merge_projections`
turns q/k/v and gate/up into one matrix product each (`linear.py`); `forward` does it first
if the loader did not.
"""

from __future__ import annotations

import torch
from torch import nn

from common.model_config import ModelConfig
from services.worker.kv_cache import KvCache
from services.worker.models.activation import silu_and_mul
from services.worker.models.attention_backend import AttentionBackend, CpuAttention
from services.worker.models.attention_metadata import AttentionMetadata
from services.worker.models.cpu_gemm import plan_for
from services.worker.models.gemm_plan import GemmPlan
from services.worker.models.linear import MergedLinear
from services.worker.models.moe import SparseMoeBlock
from services.worker.models.rms_norm import RMSNorm
from services.worker.models.rope import RotaryEmbedding, rotate
from services.worker.models.weight_arena import WeightArena
from services.worker.sharding.pipeline_stage import PipelineStage
from services.worker.sharding.tp_group import TpGroup, TpShard


class Attention(nn.Module):
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
        self.backend = backend
        self.window = window  # sliding window (`common.sliding_window`); None: full
        self.softcap: float | None = None  # tanh cap of the scores (Gemma 2); None: none
        self.sinks: torch.Tensor | None = None  # per-head sink logits (gpt-oss); None: none
        self.tp = tp
        self.num_heads = len(shard.q_heads)
        self.num_kv_heads = len(shard.kv_heads)
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
        self.qkv_proj: MergedLinear | None = None
        # fp8 KV cache scales from the checkpoint (`k_scale`, `v_scale`): per tensor or per
        # KV head of this rank, set by the loader; None: 1.0 (see `_scaled`).
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def merge_projections(self) -> None:
        self.qkv_proj = MergedLinear.merge([self.q_proj, self.k_proj, self.v_proj])
        self.o_proj = MergedLinear.merge([self.o_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, ...],
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, heads, kv_heads = hidden.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(num_tokens, heads + 2 * kv_heads, self.head_dim)
        out = self._fused(qkv, rope, cache, meta)
        if out is None:
            out = self._separate(qkv, rope, cache, meta)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, heads * self.head_dim)))

    def _separate(self, qkv, rope, cache, meta) -> torch.Tensor:
        """Attention in torch's steps: (q/k norms,) rotation, then the backend's write and
        attend (through the fp8 scales where the cache has them)."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        v = qkv[:, heads + kv_heads :]
        if self.q_norm is not None and self.k_norm is not None:
            q = rotate(self.q_norm(qkv[:, :heads]), rope)
            k = rotate(self.k_norm(qkv[:, heads : heads + kv_heads]), rope)
        else:  # queries and keys are adjacent heads: one rotation for both
            qk = rotate(qkv[:, : heads + kv_heads], rope)
            q, k = qk[:, :heads], qk[:, heads:]
        k_cache, v_cache = cache
        if self.kv_scales is not None and k_cache.element_size() == 1:
            return self._scaled(q, k, v, k_cache, v_cache, meta)
        return self.backend.forward(
            q, k, v, k_cache, v_cache, meta, self.scale, self.window, softcap=self.softcap,
            sinks=self.sinks,
        )  # fmt: skip

    def _fused(self, qkv, rope, cache, meta) -> torch.Tensor | None:
        """Attention through the backend's fused rotate-and-write (CPU, float32), where it
        has one and nothing sits between the projection and the rotation (no q/k norm, no
        fp8 scales); None: take the separate steps."""
        fused = getattr(self.backend, "forward_qkv", None)
        if fused is None or self.q_norm is not None or self.kv_scales is not None:
            return None
        k_cache, v_cache = cache
        return fused(
            qkv, self.num_heads, self.num_kv_heads, rope, k_cache, v_cache, meta, self.scale,
            self.window, softcap=self.softcap, sinks=self.sinks,
        )  # fmt: skip

    def _scaled(self, q, k, v, k_cache, v_cache, meta) -> torch.Tensor:
        """Attention over an fp8 cache that stores K / k_scale and V / v_scale: scores
        q.K = (q * k_scale).(K / k_scale) and the output is v_scale times the weighted
        sum of V / v_scale, so every backend stays scale-free (each scale is applied to
        the query and output heads its KV head serves)."""
        k_scale, v_scale = self.kv_scales  # [kv_heads, 1]
        group = self.num_heads // self.num_kv_heads
        q = q * k_scale.repeat_interleave(group, 0)
        out = self.backend.forward(
            q, k / k_scale, v / v_scale, k_cache, v_cache, meta, self.scale, self.window,
            softcap=self.softcap, sinks=self.sinks,
        )  # fmt: skip
        return out * v_scale.repeat_interleave(group, 0)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, shard: TpShard, tp: TpGroup):
        super().__init__()
        self.tp = tp
        hidden, inner = config.hidden_size, len(shard.inner)
        self.gate_proj = nn.Linear(hidden, inner, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inner, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inner, hidden, bias=False, dtype=dtype)
        self.gate_up_proj: MergedLinear | None = None

    def merge_projections(self) -> None:
        self.gate_up_proj = MergedLinear.merge([self.gate_proj, self.up_proj])
        self.down_proj = MergedLinear.merge([self.down_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    """Norm, attention, residual, norm, MLP (or experts), residual. A family with other
    parts (`gemma.py`, `gpt_oss.py`, `deepseek.py`) overrides `attention_class`,
    `norm_class` or `make_mlp`; the layer's shape stays this one."""

    attention_class: type[nn.Module] = Attention
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        shard: TpShard,
        tp: TpGroup,
        layer: int,
    ) -> None:
        super().__init__()
        window = config.sliding_window(layer)
        self.self_attn = self.attention_class(config, dtype, backend, shard, tp, window=window)
        self.mlp = self.make_mlp(config, dtype, shard, tp, layer)
        self.input_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = self.norm_class(
            config.hidden_size, config.rms_norm_eps, dtype
        )

    def make_mlp(
        self, config: ModelConfig, dtype: torch.dtype, shard: TpShard, tp: TpGroup, layer: int
    ) -> nn.Module:
        if config.moe is not None and config.is_moe_layer(layer):
            return SparseMoeBlock(
                config.hidden_size, config.moe, len(shard.expert_inner), dtype, tp,
                float32_weights=config.architecture == "mixtral", experts=shard.experts,
            )  # fmt: skip
        return MLP(config, dtype, shard, tp)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, ...],
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), rope, cache, meta)
        hidden, normed = self.post_attention_layernorm.add_forward(hidden, attended)
        return hidden + self.mlp(normed)


class LlamaModel(nn.Module):
    """Embeddings, decoder stack and final norm (HF's `model.` prefix); a pipeline stage
    holds its own layers, the embedding if it is first (or last with a tied LM head) and
    the norm if it is last. A family with its own layers and norm (`gemma.py`) subclasses
    it with other `layer_class` / `norm_class`."""

    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        shard: TpShard,
        tp: TpGroup,
        stage: PipelineStage,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.tp, self.vocab_start = tp, shard.vocab.start
        self.stage = stage
        self.first_layer = stage.layer_range(config.num_hidden_layers).start
        self.hidden_size, self.dtype = config.hidden_size, dtype
        self.embed_tokens: nn.Embedding | None = None
        if stage.is_first or (stage.is_last and config.tie_word_embeddings):
            # An explicit (empty) weight skips nn.Embedding's random init: on the meta
            # device its normal_ goes through torch._refs, which imports torch._dynamo.
            rows = torch.empty(shard.vocab_per_rank, config.hidden_size, dtype=dtype)
            self.embed_tokens = nn.Embedding(rows.shape[0], rows.shape[1], _weight=rows)
        self.layers = nn.ModuleList(
            self.layer_class(config, dtype, backend, shard, tp, layer)
            for layer in stage.layer_range(config.num_hidden_layers)
        )
        self.norm = (
            self.norm_class(config.hidden_size, config.rms_norm_eps, dtype)
            if stage.is_last
            else None
        )
        self.rotary_emb = RotaryEmbedding(
            config.rope_head_dim,
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
    ) -> torch.Tensor | None:
        metas = [self.backend.prepare(m) for m in meta.groups or (meta,)]
        meta = metas[0]
        if self.stage.is_first:
            hidden = self._embed(input_ids)
        else:
            hidden = self.stage.receive_hidden(
                input_ids.shape[0], self.hidden_size, self.dtype, input_ids.device
            )
        rope = self.rotary_emb.tables(positions, hidden.dtype, meta.rope_lengths)
        needed = kv_cache.on_layer_needed  # a KV connector's layer-wise loads, if any
        for index, layer in enumerate(self.layers):
            if needed is not None:
                needed(index)  # this layer's KV loaded before its attention reads it
            group = kv_cache.group_of(index) if len(metas) > 1 else 0
            hidden = layer(hidden, rope, kv_cache.layer(index), metas[group])
            kv_cache.layer_written(self.first_layer + index)  # the model's layer number
        if self.norm is None:  # not the last stage: the next one goes on from here
            self.stage.send_hidden(hidden)
            return None
        return self.norm(hidden)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start  # rows outside this rank's vocabulary give 0
        outside = (local < 0) | (local >= self.embed_tokens.num_embeddings)
        hidden = self.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0.0))


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; `forward` returns hidden states, `compute_logits` the logits."""

    model_class: type[LlamaModel] = LlamaModel

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        attention: AttentionBackend | None = None,
        tp: TpGroup | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.attention = attention or CpuAttention()
        self.tp = tp or TpGroup()
        self.stage = stage or PipelineStage()
        self.shard = self.tp.shard(config)
        self.model = self.model_class(
            config, dtype, self.attention, self.shard, self.tp, self.stage
        )
        vocab = self.shard.vocab_per_rank
        self.lm_head: nn.Module | None = None
        if self.stage.is_last:
            self.lm_head = nn.Linear(config.hidden_size, vocab, bias=False, dtype=dtype)
        self.tie_weights()
        self.merged = False
        self.weight_arena: WeightArena | None = None  # the packed weights' memory (CPU)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config asks for it (until
        the projections are merged: the head then has a layout of its own)."""
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.model.embed_tokens.weight

    def merge_projections(self) -> None:
        """Merge q/k/v and gate/up and lay weights out for the device (after loading;
        idempotent). A tied LM head too: on CPU it gets a transposed (and, packed, a
        panel) copy of the embedding matrix, since `x @ E.T` straight from the embedding
        reads it at half the memory bandwidth (7.2 ms against 2.9 for one row of a
        49,152-word vocabulary); elsewhere it keeps sharing the embedding's storage."""
        if self.merged:
            return
        for layer in self.model.layers:
            layer.self_attn.merge_projections()
            layer.mlp.merge_projections()
        if self.lm_head is not None:
            self.lm_head = MergedLinear.merge([self.lm_head])
            if self.config.tie_word_embeddings and not self.stage.is_first:
                self.model.embed_tokens = None  # a last stage held it only for the head
        self.merged = True

    def pack_weights(self, cpu_gemm: str | GemmPlan = "auto") -> tuple[int, GemmPlan]:
        """Add packed copies of the merged weights for decode-sized batches (CPU, float32;
        see `linear.py`): the format and row counts `cpu_gemm` names or, for `auto`,
        measures on these weights, or a plan already made (a draft model takes its target's:
        the format depends on the CPU, not on the layer sizes). Returns the bytes the copies
        take and the plan."""
        self.merge_projections()
        layers = [m for m in self.modules() if isinstance(m, MergedLinear) and m.packable]
        plan = (
            cpu_gemm
            if isinstance(cpu_gemm, GemmPlan)
            else plan_for(cpu_gemm, [m.weight for m in layers])
        )
        packed_bytes = sum(m.pack(plan) for m in layers)
        if plan.packed_format == "tandem":  # plain panels (and block panels): into huge pages
            packed = [m for m in layers if m.packed is not None]
            blocks = [m for m in layers if m.blocks is not None]
            self.weight_arena = WeightArena([m.packed for m in packed] + [m.blocks for m in blocks])
            views = iter(self.weight_arena.views)
            for m in packed:
                m.packed = next(views)
            for m in blocks:
                m.blocks = next(views)
        return packed_bytes, plan

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KvCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Flat new tokens `[T]` at `positions` `[T]` -> final hidden states `[T, hidden]`
        (None on a pipeline stage before the last: it sent its hidden states on)."""
        if not self.merged:
            with torch.inference_mode(False), torch.no_grad():
                self.merge_projections()
        self._check_cache(kv_cache, meta)
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(
                f"input_ids and positions must both be [T], got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        return self.model(input_ids, positions, kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, hidden]` -> float32 logits `[N, vocab]` (gathered from every rank)."""
        logits = self.lm_head(hidden).float()
        if self.tp.size == 1:
            return logits
        return self.tp.gather_last_dim(logits)[:, : self.config.vocab_size]

    def _check_cache(self, kv_cache: KvCache, meta: AttentionMetadata) -> None:
        config = self.config
        layers = len(self.stage.layer_range(config.num_hidden_layers))
        expected = (layers, len(self.shard.kv_heads), config.head_dim)
        actual = (len(kv_cache.layer_slots), kv_cache.num_kv_heads, kv_cache.head_dim)
        if actual != expected:
            raise ValueError(
                f"KV cache geometry (layers, kv_heads, head_dim)={actual} does not match "
                f"the model's {expected}"
            )
        if meta.block_size != kv_cache.block_size:
            raise ValueError(
                f"metadata block_size {meta.block_size} != cache block_size {kv_cache.block_size}"
            )
