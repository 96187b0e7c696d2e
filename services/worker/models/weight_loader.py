"""Loads a Hugging Face checkpoint's weights into our `LlamaForCausalLM` modules (Gemma's:
`gemma.GemmaForCausalLM`; DeepSeek's: `deepseek.DeepseekForCausalLM`; the files themselves
are read by `common.hf_checkpoint_reader`).

Reads the config through `ModelConfig.from_folder`, builds the module skeleton on the meta
device (no wasted random init), then reads `model.safetensors` or the shards listed in
`model.safetensors.index.json` and assigns the tensors, cast to the requested dtype and
device. Loading is strict: a missing or unexpected weight is a `ValueError` naming a few of
them (rotary `inv_freq` buffers, which some checkpoints carry, are ignored).

`tp` loads one tensor-parallel rank's slice of every weight (`sharding/weight_shards.py`).
`stage` loads one pipeline stage's part: its decoder layers (HF's layer `i` as its layer
`i - first`) and, where the stage holds them, the embedding, final norm and LM head; the
other layers' weights are skipped unread. `num_layers` loads only the first N decoder
layers (then the final norm and LM head): the truncated, self-speculative draft of
`spec_decode`; the later layers' weights are skipped unread. Quantized checkpoints
(`quantized_weights.py`: compressed-tensors FP8, GPTQ) are dequantized module by module as
their tensors are read or, where `packed_matmul` says so (CUDA by default), kept packed and
merged into `quantized_linear.QuantizedLinear` layers for the Triton quantized matmul.
A mixture-of-experts checkpoint's per-expert tensors are stacked per layer as they are read
(`expert_weights.py`); quantized MoE checkpoints are refused, except gpt-oss's MXFP4 experts,
dequantized to the model's dtype as they are read (`gpt_oss_weights.py`, which also lays out
its unquantized experts).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import torch

from common.hf_checkpoint_reader import iter_tensors
from common.model_config import ModelConfig
from services.worker.models.attention_backend import AttentionBackend
from services.worker.models.deepseek import DeepseekForCausalLM
from services.worker.models.expert_weights import stacked_experts
from services.worker.models.gemma import causal_lm_class
from services.worker.models.gpt_oss_weights import gpt_oss_tensors, is_mxfp4_checkpoint
from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.quantized_weights import (
    QuantizedWeight,
    dequantized,
    packed_matmul,
    quant_format,
    quantized_layers,
)
from services.worker.sharding.pipeline_stage import PipelineStage
from services.worker.sharding.tp_group import TpGroup
from services.worker.sharding.weight_shards import shard_weight

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# fp8 KV cache scales (compressed-tensors / vLLM naming), used with --kv-cache-dtype fp8.
_KV_SCALES = ("self_attn.k_scale", "self_attn.v_scale")
_FLOAT32_SUFFIXES = ("mlp.gate.e_score_correction_bias",)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Held by the pipeline stages that need them only (first / last).
_STAGE_ENDS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def set_kv_scales(
    model: LlamaForCausalLM, scales: dict[str, torch.Tensor], config: ModelConfig, device
) -> None:
    """Each layer's fp8 KV scales (a scalar, or one per KV head of the model: this rank's
    are kept), as `[kv_heads, 1]` float32 on `Attention.kv_scales`; a layer needs both."""
    kv_heads = model.shard.kv_heads
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}.self_attn."
        pair = [scales.pop(prefix + kind, None) for kind in ("k_scale", "v_scale")]
        if pair == [None, None]:
            continue
        if None in pair:
            raise ValueError(f"{prefix}k_scale and v_scale come together; one is missing")
        out = []
        for scale in pair:
            scale = scale.float().flatten()
            if scale.numel() == config.num_key_value_heads:
                scale = scale[kv_heads.start : kv_heads.stop]
            elif scale.numel() != 1:
                raise ValueError(
                    f"{prefix} KV scales must be one value or one per KV head "
                    f"({config.num_key_value_heads}), got {scale.numel()}"
                )
            if not bool((scale > 0).all()) or not bool(torch.isfinite(scale).all()):
                raise ValueError(f"{prefix} KV scales must be positive and finite")
            out.append(scale.expand(len(kv_heads)).reshape(-1, 1).clone().to(device))
        layer.self_attn.kv_scales = (out[0], out[1])
    if scales:
        raise ValueError(f"KV scales for layers the model does not have: {sorted(scales)[:4]}")


def load_model(
    folder: str | os.PathLike,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    attention: AttentionBackend | None = None,
    num_layers: int | None = None,
    tp: TpGroup | None = None,
    stage: PipelineStage | None = None,
    quantized_matmul: str = "auto",
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for `folder` and load its weights; returns (model in eval mode, config
    — with `num_hidden_layers` = `num_layers` when that truncates it). `quantized_matmul`:
    auto / triton / dense, how quantized layers run (`quantized_weights.packed_matmul`)."""
    path = Path(folder)
    config = ModelConfig.from_folder(path)
    if num_layers is not None:
        if not 1 <= num_layers <= config.num_hidden_layers:
            raise ValueError(
                f"num_layers must be in [1, {config.num_hidden_layers}] for {str(path)!r}, "
                f"got {num_layers}"
            )
        config = dataclasses.replace(config, num_hidden_layers=num_layers)
    device = torch.device(device)
    with torch.device("meta"):
        model_class = DeepseekForCausalLM if config.mla is not None else causal_lm_class(config)
        model = model_class(config, dtype=dtype, attention=attention, tp=tp, stage=stage)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    tied_head = "lm_head.weight" if config.tie_word_embeddings else None

    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []

    layers = model.stage.layer_range(config.num_hidden_layers)

    def wanted(name: str) -> bool:
        layer = _LAYER.match(name)
        if layer is not None and int(layer.group(1)) not in layers:
            return False  # another stage's layer, or beyond a truncated model's layers
        if name in _STAGE_ENDS and name not in expected:
            return False  # another pipeline stage holds it
        return name != tied_head and not name.endswith(_IGNORED_SUFFIXES)

    def local_name(name: str) -> str:
        layer = _LAYER.match(name)
        if layer is None or layers.start == 0:
            return name
        return f"model.layers.{int(layer.group(1)) - layers.start}.{name[layer.end() :]}"

    kv_scales: dict[str, torch.Tensor] = {}
    mxfp4 = config.gpt_oss is not None and is_mxfp4_checkpoint(path)  # (gpt-oss's experts)
    fmt = None if mxfp4 else quant_format(path)  # an unsupported format stops here, named
    if fmt is not None and config.moe is not None:
        raise ValueError(
            f"quantized {config.architecture} checkpoints are not supported (mixture-of-experts "
            f"weights load unquantized only)"
        )
    if fmt is not None and config.mla is not None:
        raise ValueError(f"quantized {config.architecture} checkpoints are not supported")
    tensors = iter_tensors(path, keep=wanted)
    if config.gpt_oss is not None:
        tensors = gpt_oss_tensors(tensors, dtype)
    elif config.moe is not None:
        tensors = stacked_experts(tensors, config.moe.num_experts)
    packed: dict[str, QuantizedWeight] = {}  # layers kept quantized, by their weight's name
    if packed_matmul(fmt, device, model.tp.size, quantized_matmul):
        tensors = quantized_layers(tensors, fmt)
    else:
        tensors = dequantized(tensors, fmt, dtype)
    for name, tensor in tensors:
        name = local_name(name)
        if name.endswith(_KV_SCALES):
            kv_scales[name] = tensor
            continue
        if name not in expected:
            unexpected.append(name)
            continue
        tensor = shard_weight(name, tensor, config, model.shard)  # a TP rank's slice
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"weight {name} has shape {tuple(tensor.shape)}, model expects {expected[name]}"
            )
        if isinstance(tensor, QuantizedWeight):
            packed[name] = tensor.to(device)
            continue
        # (DeepSeek-V3's router bias stays float32, as transformers keeps it)
        kept = torch.float32 if name.endswith(_FLOAT32_SUFFIXES) else dtype
        state[name] = tensor.to(device=device, dtype=kept)
    missing = sorted(set(expected) - set(state) - set(packed) - {tied_head})
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {str(path)!r} does not match the {config.architecture} model: "
            f"missing {len(missing)} weights {missing[:5]}, "
            f"unexpected {len(unexpected)} weights {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    if packed:
        from services.worker.models.quantized_linear import install_quantized  # imports Triton

        install_quantized(model, packed)  # merges every projection
    model.to(device)
    if kv_scales and config.mla is not None:
        raise ValueError(
            f"fp8 KV scales (k_scale / v_scale) are not supported with {config.architecture}'s "
            f"latent attention"
        )
    set_kv_scales(model, kv_scales, config, device)
    model.eval()
    model.requires_grad_(False)
    model.merge_projections()
    return model, config
