"""The Triton quantized matmuls (`kernels/quant_matmul.py`) against dequantize-then-matmul,
and quantized checkpoints loaded packed (`QuantizedLinear`) against the same checkpoints
loaded dequantized.

Without CUDA the kernels run under the Triton CPU interpreter (selected below, before the
kernel modules are imported) on tiny shapes, and the packed path is forced on CPU with
`quantized_matmul="triton"`; with CUDA the kernel cases run compiled on the GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel definitions

import pytest  # noqa: E402

from kernels.quant_matmul import (  # noqa: E402
    fp8_matmul,
    fp8_reference,
    gptq_matmul,
    gptq_reference,
)
from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.kv_cache import KvCache  # noqa: E402
from services.worker.lora.layers import LoraContext, install_lora  # noqa: E402
from services.worker.models.attention_backend import TorchAttention  # noqa: E402
from services.worker.models.attention_metadata import (  # noqa: E402
    SequenceSlice,
    build_attention_metadata,
)
from services.worker.models.quantized_linear import QuantizedLinear  # noqa: E402
from services.worker.models.quantized_weights import (  # noqa: E402
    MATMUL_SETTING,
    QuantFormat,
    QuantizedWeight,
    fp8_weight,
    gptq_weight,
    packed_matmul,
)
from services.worker.models.weight_loader import load_model  # noqa: E402
from tests.unit.test_quantized_weights import (  # noqa: E402
    TOKENS,
    dense_weights,
    gptq_quantize,
    is_linear,
    pack,
    rewrite,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = dict(atol=1e-4, rtol=1e-4)
SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def gptq_layer(num_in, num_out, bits, group, act_order, seed):
    """Random packed GPTQ tensors: (qweight, qzeros, scales fp16, g_idx or None)."""
    gen = torch.Generator().manual_seed(seed)
    levels = 1 << bits
    groups = -(-num_in // group)
    q = torch.randint(0, levels, (num_in, num_out), generator=gen)
    zeros = torch.randint(0, levels, (groups, num_out), generator=gen)
    scales = (torch.rand(groups, num_out, generator=gen) * 0.05 + 0.01).half()
    g_idx = None
    if act_order:
        perm = torch.randperm(num_in, generator=gen)
        g_idx = torch.empty(num_in, dtype=torch.int32)
        g_idx[perm] = (torch.arange(num_in) // group).int()
    qzeros = pack(zeros.t().contiguous(), bits).t().contiguous()
    return pack(q, bits), qzeros, scales, g_idx


def on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("zero_offset", [0, 1])
def test_gptq_matmul_matches_dequantize_then_matmul(bits, act_order, zero_offset):
    tensors = gptq_layer(64, 48, bits, 32, act_order, seed=bits + 2 * zero_offset)
    fmt = QuantFormat("gptq", bits, 32, zero_offset)
    dense = gptq_weight(*tensors, fmt)  # the loader's own dequantization
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(48) if act_order else None
    expected = x @ dense.t() + (0 if bias is None else bias)
    reference = gptq_reference(x, *tensors, bits, 32, zero_offset, bias)
    torch.testing.assert_close(reference, expected, **TOLERANCE)
    args = on_device(x, *tensors, bias)
    got = gptq_matmul(*args[:5], bits, 32, zero_offset, args[5])
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_matmul_masks_odd_shapes_and_groups(bits):
    """in 72 (a partial K step), out 40 (a partial column tile), groups of 24 (not a
    whole K step: each row finds its group), 3 token rows, no g_idx."""
    tensors = gptq_layer(72, 40, bits, 24, False, seed=7)
    x, *parts = on_device(torch.randn(3, 72), *tensors)
    got = gptq_matmul(x, *parts, bits, 24, 1)
    torch.testing.assert_close(got, gptq_reference(x, *parts, bits, 24, 1), **TOLERANCE)
    assert gptq_matmul(x[:0], *parts, bits, 24, 1).shape == (0, 40)


def test_gptq_matmul_in_half_precision():
    tensors = on_device(*gptq_layer(64, 48, 4, 32, True, seed=3))
    x = torch.randn(5, 64, device=DEVICE).half()
    got = gptq_matmul(x, *tensors, 4, 32, 0)
    assert got.dtype == torch.float16
    reference = gptq_reference(x.float(), *tensors, 4, 32, 0)
    torch.testing.assert_close(got.float(), reference, atol=2e-2, rtol=2e-2)


def every_fp8_code(rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] float8 e4m3fn cycling through every finite code (subnormals, -0)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    order = torch.randperm(rows * cols, generator=torch.Generator().manual_seed(0))
    return codes[order % len(codes)].reshape(rows, cols).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
@pytest.mark.parametrize("native", [True, False])
def test_fp8_matmul_matches_dequantize_then_matmul(strategy, native):
    if native and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 conversions need compute capability 8.9")
    weight = every_fp8_code(48, 64)
    scale = torch.rand(48, 1) * 1e-3 + 1e-4 if strategy == "channel" else torch.tensor([2e-4])
    x, bias = torch.randn(5, 64), torch.randn(48)
    expected = x @ fp8_weight(weight, scale).t() + bias
    torch.testing.assert_close(fp8_reference(x, weight, scale, bias), expected, **TOLERANCE)
    args = on_device(x, weight, scale.contiguous(), bias)
    got = fp8_matmul(*args, native=native)
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE)


def quantized(module: str, tensors, fmt: QuantFormat) -> QuantizedWeight:
    parts = dict(zip(("qweight", "qzeros", "scales", "g_idx"), on_device(*tensors), strict=True))
    return QuantizedWeight(fmt, module, {k: v for k, v in parts.items() if v is not None})


@pytest.mark.parametrize("shared_g_idx", [True, False])
def test_merged_gptq_parts_join_when_their_groups_agree(shared_g_idx):
    """q/k/v read one input: with one act-order g_idx they join into one matrix; parts
    grouped differently run as separate matmuls. Either way, the outputs concatenate."""
    fmt = QuantFormat("gptq", 4, 32, 1)
    layers = [gptq_layer(64, out, 4, 32, True, seed=i) for i, out in enumerate((32, 16, 16))]
    if shared_g_idx:
        layers = [(*layer[:3], layers[0][3]) for layer in layers]
    weights = [quantized(name, layer, fmt) for name, layer in zip("qkv", layers, strict=True)]
    bias = torch.randn(64, device=DEVICE)
    merged = QuantizedLinear.merge(weights, list(bias.split([32, 16, 16])))
    assert len(merged.packs) == (1 if shared_g_idx else 3)
    x = torch.randn(5, 64, device=DEVICE)
    dense = torch.cat([w.dense(torch.float32) for w in weights])
    torch.testing.assert_close(merged(x), x @ dense.t() + bias, **TOLERANCE)
    assert [t.shape[-1] for t in merged.split(x)] == [32, 16, 16]
    with pytest.raises(ValueError, match=MATMUL_SETTING):
        merged.weight  # noqa: B018  (LoRA and other dense-weight readers are refused)


def test_matmul_switch_and_its_limits():
    fmt, cuda, cpu = QuantFormat("fp8"), torch.device("cuda"), torch.device("cpu")
    assert packed_matmul(fmt, cuda) and not packed_matmul(fmt, cpu)
    assert not packed_matmul(fmt, cuda, tp_size=2)  # auto: dequantized for TP
    assert not packed_matmul(None, cuda)
    assert not packed_matmul(fmt, cuda, choice="dense")
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        packed_matmul(fmt, cuda, tp_size=2, choice="triton")
    with pytest.raises(ValueError, match="'marlin'"):
        packed_matmul(fmt, cuda, choice="marlin")
    with pytest.raises(ValueError, match="quantized_matmul"):
        WorkerConfig(model="/m", quantized_matmul="marlin")


def gptq_checkpoint(source, target, bits: int, fmt: str, act_order: bool):
    """The tiny Llama's linear layers quantized as GPTQ would: layers reading one input
    (q/k/v, gate/up) share their act-order permutation, hence their g_idx."""
    out, perms, gen = {}, {}, torch.Generator().manual_seed(bits)
    for name, tensor in dense_weights(source).items():
        if not is_linear(name):
            out[name] = tensor
            continue
        module = name.removesuffix(".weight")
        owner, leaf = module.rsplit(".", 1)
        reads = f"{owner}.{SHARED_INPUT.get(leaf, leaf)}"
        if reads not in perms:
            num_in = tensor.shape[1]
            perms[reads] = (
                torch.randperm(num_in, generator=gen) if act_order else torch.arange(num_in)
            )
        q, zeros, scales, g_idx, _ = gptq_quantize(tensor, bits, 32, perms[reads])
        out[f"{module}.qweight"] = pack(q, bits)
        stored_zeros = zeros - (1 if fmt == "gptq" else 0)
        out[f"{module}.qzeros"] = pack(stored_zeros.t().contiguous(), bits).t().contiguous()
        out[f"{module}.scales"] = scales
        out[f"{module}.g_idx"] = g_idx
    quantization = {"quant_method": "gptq", "bits": bits, "group_size": 32,
                    "desc_act": act_order, "checkpoint_format": fmt}  # fmt: skip
    return rewrite(source, target, out, quantization)


def fp8_checkpoint(source, target, strategy: str, ignore: tuple[str, ...]):
    """FP8 with one scale per output row (`channel`) or per tensor; layers named in
    `ignore` stay dense (an ignored v_proj makes q/k/v a mixed, dense merge)."""
    out = {}
    for name, tensor in dense_weights(source).items():
        if not is_linear(name) or name.split(".")[-2] in ignore:
            out[name] = tensor
            continue
        amax = (
            tensor.abs().amax(dim=1, keepdim=True) if strategy == "channel" else tensor.abs().max()
        )
        scale = (amax / 448.0).clamp(min=1e-12).reshape(-1, 1)
        out[name] = (tensor / scale).to(torch.float8_e4m3fn)
        out[name.replace(".weight", ".weight_scale")] = scale
    weights = {"num_bits": 8, "type": "float", "strategy": strategy}
    quantization = {"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"g": {"targets": ["Linear"], "weights": weights}},
                    "ignore": ["lm_head", *ignore]}  # fmt: skip
    return rewrite(source, target, out, quantization)


@pytest.mark.parametrize(
    "kind", ["gptq-4bit-act-order", "gptq_v2-8bit", "fp8-channel", "fp8-tensor-v-dense"]
)
def test_packed_model_matches_the_dequantized_model(tiny_llama_dir, tmp_path, kind):
    if kind == "fp8-channel":
        folder = fp8_checkpoint(tiny_llama_dir, tmp_path / kind, "channel", ())
    elif kind == "fp8-tensor-v-dense":
        folder = fp8_checkpoint(tiny_llama_dir, tmp_path / kind, "tensor", ("v_proj",))
    elif kind == "gptq-4bit-act-order":
        folder = gptq_checkpoint(tiny_llama_dir, tmp_path / kind, 4, "gptq", act_order=True)
    else:
        folder = gptq_checkpoint(tiny_llama_dir, tmp_path / kind, 8, "gptq_v2", act_order=False)
    dense = prompt_logits(folder, "dense")
    packed = prompt_logits(folder, "triton")
    torch.testing.assert_close(packed, dense, **TOLERANCE)


def prompt_logits(folder, quantized_matmul: str) -> torch.Tensor:
    """The model's float32 logits over `TOKENS` as one prompt, on `DEVICE`."""
    model, config = load_model(
        folder, torch.float32, DEVICE, attention=TorchAttention(), quantized_matmul=quantized_matmul
    )
    cache = KvCache(8, 4, config.num_hidden_layers, config.num_key_value_heads,
                    config.head_dim, torch.float32, DEVICE)  # fmt: skip
    table = [5, 2, 7]  # 3 blocks of 4 for the 12 tokens, out of order
    positions, meta = build_attention_metadata([SequenceSlice(0, len(TOKENS), table)], 4, DEVICE)
    with torch.inference_mode():
        hidden = model(torch.tensor(TOKENS, device=DEVICE), positions, cache, meta)
        return model.compute_logits(hidden).cpu()


def test_packed_model_merges_projections_and_refuses_lora(tiny_llama_dir, tmp_path):
    folder = gptq_checkpoint(tiny_llama_dir, tmp_path / "gptq", 4, "gptq", act_order=True)
    model, _ = load_model(folder, torch.float32, DEVICE, quantized_matmul="triton")
    layer = model.model.layers[0]
    projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj)
    assert all(isinstance(p, QuantizedLinear) and len(p.packs) == 1 for p in projections)
    assert layer.self_attn.qkv_proj.sizes == (64, 32, 32)
    with pytest.raises(ValueError, match=MATMUL_SETTING):
        install_lora(model, LoraContext(), num_slots=1, max_rank=8)
