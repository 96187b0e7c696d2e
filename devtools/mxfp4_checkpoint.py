"""Stores a gpt-oss checkpoint's experts in MXFP4, as OpenAI's published checkpoints do, for
tests (Tandem never downloads models; `checkpoint_builder` makes them unquantized).

`quantize_mxfp4` rounds a matrix `[..., N]` to MXFP4: per block of 32 values one E8M0 scale
2^e with e = ceil(log2(max |x| / 6)) (so the block's largest magnitude fits FP4's 6), each
value divided by it and rounded to the nearest FP4 (e2m1) value, two 4-bit codes per byte
(even element in the low nibble). `quantize_checkpoint_experts` rewrites a gpt-oss folder:
each layer's `mlp.experts.gate_up_proj` `[E, H, 2I]` becomes `gate_up_proj_blocks`
`[E, 2I, H / 32, 16]` / `gate_up_proj_scales` `[E, 2I, H / 32]` (of its transpose, as the
real checkpoints lay it out), `down_proj` `[E, I, H]` becomes `down_proj_blocks` /
`_scales` of `[E, H, I]`; the biases, router and attention stay as they were, and
`config.json` gains `quantization_config` (`quant_method` "mxfp4", the real checkpoints'
`modules_to_not_convert`). Rounding is this module's own (transformers quantizes only
through its GPU kernels); the dequantized weights are whatever the blocks say, which is what
loaders must reproduce.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")
NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., N]` (N a multiple of 32) -> (blocks uint8 `[..., N / 32, 16]`, scales uint8
    `[..., N / 32]`)."""
    if weight.shape[-1] % 32:
        raise ValueError(f"MXFP4 needs a last dimension divisible by 32, got {weight.shape}")
    x = weight.float().reshape(*weight.shape[:-1], -1, 32)
    amax = x.abs().amax(dim=-1)
    exponent = torch.ceil(torch.log2(amax / 6.0)).nan_to_num(-127.0, -127.0, -127.0)
    exponent = exponent.clamp(-127, 127)
    scaled = x / torch.exp2(exponent).unsqueeze(-1)
    code = (scaled.abs().unsqueeze(-1) - FP4_MAGNITUDES).abs().argmin(dim=-1)  # nearest
    code = code | (scaled < 0).long() << 3
    blocks = (code[..., 0::2] | code[..., 1::2] << 4).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def quantize_checkpoint_experts(folder: str | os.PathLike) -> Path:
    """Rewrite `folder` (a single-file gpt-oss checkpoint) with MXFP4 experts."""
    path = Path(folder)
    weights_path = path / "model.safetensors"
    tensors = load_file(weights_path)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _EXPERTS.match(name)
        if match is None:
            out[name] = tensor
            continue
        blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))
        out[f"{name}_blocks"], out[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(out, weights_path, metadata={"format": "pt"})
    weights_path.chmod(0o644)
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": NOT_CONVERTED,
    }
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return path
