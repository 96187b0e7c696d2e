"""Quantized checkpoints, written in their published layouts by the test: compressed-tensors
FP8 (per-channel and per-tensor scales) read by HF through the `compressed-tensors` library
as the reference; GPTQ 4-bit (groups of 32, act-order `g_idx`, the `gptq` format's
zeros-minus-one) and 8-bit (`gptq_v2`) against HF running the dense weights the test
quantized to (taken from the integers before packing, so packing, zeros and groups are all
checked). Unsupported formats are refused naming them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from services.worker.models.weight_loader import load_model
from tests.unit.test_model_parity import PagedSession

TOKENS = [5, 17, 230, 44, 9, 310, 12, 8, 77, 501, 3, 66]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def ours_logits(folder: Path) -> torch.Tensor:
    model, config = load_model(folder, torch.float32)
    session = PagedSession(model, config, block_size=4)
    table = session.allocate(len(TOKENS))
    (logits,) = session.step([(TOKENS, 0, len(TOKENS), table)])
    return logits


def hf_logits(folder: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].float()


def rewrite(source: Path, target: Path, tensors: dict, quantization: dict | None) -> Path:
    shutil.copytree(source, target)
    for stale in target.glob("model*.safetensors*"):
        stale.unlink()
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    if quantization is not None:
        config["quantization_config"] = quantization
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def dense_weights(folder: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {k: v.clone().contiguous() for k, v in model.state_dict().items()}


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEAR


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_fp8_compressed_tensors_match_hf(tiny_llama_dir, tmp_path, strategy):
    weights, out = dense_weights(tiny_llama_dir), {}
    for name, tensor in weights.items():
        if not is_linear(name):
            out[name] = tensor
            continue
        amax = (
            tensor.abs().amax(dim=1, keepdim=True) if strategy == "channel" else tensor.abs().max()
        )
        scale = (amax / 448.0).clamp(min=1e-12).float()
        out[name] = (tensor / scale).to(torch.float8_e4m3fn)
        out[name.replace(".weight", ".weight_scale")] = (
            scale.reshape(-1, 1) if strategy == "channel" else scale.reshape(1)
        )
    quantization = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                            "symmetric": True, "dynamic": False},
            }
        },
        "ignore": ["lm_head"],
    }  # fmt: skip
    folder = rewrite(tiny_llama_dir, tmp_path / "fp8", out, quantization)
    ours, reference = ours_logits(folder), hf_logits(folder)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    unquantized = hf_logits(tiny_llama_dir)
    assert float((ours - unquantized).abs().max()) > 0  # the weights really were rounded


def gptq_quantize(weight: torch.Tensor, bits: int, group: int, perm: torch.Tensor):
    """Asymmetric round-to-nearest per group of input rows, groups taken in `perm` order
    (act-order): returns (q [in, out] ints, zeros [groups, out], scales fp16, g_idx, the
    dense weight those integers stand for)."""
    w = weight.t()  # [in, out]
    num_in = w.shape[0]
    g_idx = torch.empty(num_in, dtype=torch.int32)
    g_idx[perm] = (torch.arange(num_in) // group).int()
    levels = (1 << bits) - 1
    groups = num_in // group
    scales = torch.empty(groups, w.shape[1])
    zeros = torch.empty(groups, w.shape[1], dtype=torch.int32)
    for g in range(groups):
        rows = w[g_idx == g]
        low, high = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        scales[g] = ((high - low) / levels).clamp(min=1e-8)
        zeros[g] = torch.round(-low / scales[g]).clamp(0, levels).int()
    scales = scales.half()
    s, z = scales.float()[g_idx.long()], zeros[g_idx.long()]
    q = torch.clamp(torch.round(w / s) + z, 0, levels).int()
    dense = ((q - z).float() * s).t().contiguous()
    return q, zeros, scales, g_idx, dense


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] unsigned ints -> int32 words packing rows along axis 0, lowest first."""
    per = 32 // bits
    values = values.to(torch.int64).reshape(-1, per, values.shape[1])
    word = torch.zeros(values.shape[0], values.shape[2], dtype=torch.int64)
    for j in range(per):
        word |= values[:, j] << (bits * j)
    return word.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else word.int()


@pytest.mark.parametrize(("bits", "fmt"), [(4, "gptq"), (8, "gptq_v2")])
def test_gptq_matches_hf_on_the_dense_weights(tiny_llama_dir, tmp_path, bits, fmt):
    weights, out, dense = dense_weights(tiny_llama_dir), {}, {}
    generator = torch.Generator().manual_seed(bits)
    for name, tensor in weights.items():
        if not is_linear(name):
            out[name] = dense[name] = tensor
            continue
        perm = torch.randperm(tensor.shape[1], generator=generator)  # act-order groups
        q, zeros, scales, g_idx, dense[name] = gptq_quantize(tensor, bits, 32, perm)
        module = name.removesuffix(".weight")
        stored_zeros = zeros - (1 if fmt == "gptq" else 0)  # the `gptq` format's offset
        out[f"{module}.qweight"] = pack(q, bits)
        out[f"{module}.qzeros"] = pack(stored_zeros.t().contiguous(), bits).t().contiguous()
        out[f"{module}.scales"] = scales
        out[f"{module}.g_idx"] = g_idx
    quantization = {"quant_method": "gptq", "bits": bits, "group_size": 32, "desc_act": True,
                    "sym": False, "checkpoint_format": fmt}  # fmt: skip
    folder = rewrite(tiny_llama_dir, tmp_path / "gptq", out, quantization)
    reference = rewrite(tiny_llama_dir, tmp_path / "dense", dense, None)
    torch.testing.assert_close(ours_logits(folder), hf_logits(reference), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"quant_method": "awq", "bits": 4}, "'awq'"),
        ({"quant_method": "gptq", "bits": 3}, "bits=3"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "'pack-quantized'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}
                },
            },
            "'block'",
        ),  # fmt: skip
    ],
)
def test_unsupported_formats_are_refused_naming_them(tiny_llama_dir, tmp_path, quantization, named):
    folder = rewrite(
        tiny_llama_dir,
        tmp_path / "q",
        load_file(next(tiny_llama_dir.glob("model-00001*"))),
        quantization,
    )
    with pytest.raises(ValueError) as refused:
        load_model(folder, torch.float32)
    assert named in str(refused.value) and "\n" not in str(refused.value)
