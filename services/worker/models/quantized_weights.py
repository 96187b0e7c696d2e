"""Quantized checkpoints: which formats load, and their linear layers turned back into dense
weights as they are read (module by module, never the whole model at once).

- `compressed-tensors`, `float-quantized` format (the FP8 checkpoints published for vLLM):
  `X.weight` in float8 e4m3 and `X.weight_scale` (one per tensor, or one per output
  channel); W = weight * scale. Activation scales (`X.input_scale`) are not needed: the
  matmul runs in the model's dtype.
- `gptq` (AutoGPTQ / GPTQModel, 4 or 8 bits, any group size, act-order `g_idx`):
  `X.qweight` int32 `[in / pack, out]` (pack = 32 / bits values per word, lowest bits
  first), `X.qzeros` int32 `[groups, out / pack]`, `X.scales` `[groups, out]`, `X.g_idx`
  (each input row's group; `i // group_size` when absent);
  W[o, i] = scales[g, o] * (q[i, o] - zero[g, o]) with g = g_idx[i]. The `gptq` checkpoint
  format stores each zero minus one (AutoGPTQ's historical offset), `gptq_v2` as is.

Anything else in `quantization_config` (AWQ, bitsandbytes, other compressed-tensors
formats, other bit widths) is refused at start, naming it. On CPU the dense weights then go
through the usual path (tensor-parallel slicing, merged projections, packed matmuls); a
quantized matmul on GPU is not built.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
FP8_PARTS = ("weight", "weight_scale", "input_scale")


@dataclass(frozen=True)
class QuantFormat:
    method: str  # "fp8" (compressed-tensors float-quantized) or "gptq"
    bits: int = 8
    group_size: int = -1
    zero_offset: int = 0  # added to stored GPTQ zeros (1 in the `gptq` checkpoint format)
    ignore: tuple[str, ...] = ()

    @property
    def parts(self) -> tuple[str, ...]:
        return GPTQ_PARTS if self.method == "gptq" else FP8_PARTS


def quant_format(folder: str | os.PathLike) -> QuantFormat | None:
    """The checkpoint's weight quantization (None: plain weights); ValueError naming what
    is not supported."""
    config = json.loads((Path(folder) / "config.json").read_text())
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method", "?"))
    if method == "gptq":
        return _gptq(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    raise ValueError(
        f"quantization_config.quant_method {method!r} is not supported: Tandem loads "
        f"compressed-tensors (float-quantized FP8) and gptq (4 or 8 bits) checkpoints"
    )


def _gptq(quant: dict) -> QuantFormat:
    bits = int(quant.get("bits", 0))
    if bits not in (4, 8):
        raise ValueError(f"gptq with bits={bits} is not supported (4 or 8)")
    fmt = str(quant.get("checkpoint_format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    return QuantFormat("gptq", bits, int(quant.get("group_size", -1)), 1 if fmt == "gptq" else 0)


def _compressed_tensors(quant: dict) -> QuantFormat:
    fmt = str(quant.get("format", "?"))
    if fmt != "float-quantized":
        raise ValueError(
            f"compressed-tensors format {fmt!r} is not supported (float-quantized FP8 is)"
        )
    for name, group in (quant.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if kind[:2] != ("float", 8) or kind[2] not in ("tensor", "channel"):
            raise ValueError(
                f"compressed-tensors group {name!r} has weights {kind}: only 8-bit float "
                f"weights with a per-tensor or per-channel scale are supported"
            )
    return QuantFormat("fp8", ignore=tuple(quant.get("ignore") or ()))


def dequantized(
    tensors: Iterable[tuple[str, torch.Tensor]], fmt: QuantFormat | None, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every quantized linear layer as one dense `X.weight`
    in `dtype` (yielded once its parts are all read); other tensors pass through."""
    if fmt is None:
        yield from tensors
        return
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, part = name.rpartition(".")
        if fmt.method == "fp8" and part == "input_scale":
            continue  # static activation scales: the matmul runs in the model's dtype
        if part in fmt.parts and _quantized(fmt, module, part, tensor):
            pending.setdefault(module, {})[part] = tensor
            ready = _dense(fmt, module, pending[module], dtype, final=False)
            if ready is not None:
                del pending[module]
                yield f"{module}.weight", ready
            continue
        yield name, tensor
    for module, parts in pending.items():  # g_idx-less GPTQ modules end here
        yield f"{module}.weight", _dense(fmt, module, parts, dtype, final=True)


def _quantized(fmt: QuantFormat, module: str, part: str, tensor: torch.Tensor) -> bool:
    if fmt.method == "gptq":
        return True
    if module.split(".")[-1] in fmt.ignore or module in fmt.ignore:
        return False
    return part != "weight" or tensor.dtype == torch.float8_e4m3fn


def _dense(fmt, module, parts, dtype, final: bool) -> torch.Tensor | None:
    if fmt.method == "fp8":
        if "weight" not in parts or "weight_scale" not in parts:
            if final:
                raise ValueError(f"{module}: an FP8 weight needs weight and weight_scale")
            return None
        return fp8_weight(parts["weight"], parts["weight_scale"]).to(dtype)
    if not final and len(parts) < 4:
        return None
    missing = [p for p in GPTQ_PARTS[:3] if p not in parts]
    if missing:
        raise ValueError(f"{module}: a gptq layer needs {', '.join(GPTQ_PARTS[:3])}; missing "
                         f"{missing}")  # fmt: skip
    return gptq_weight(
        parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), fmt
    ).to(dtype)


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[out, in] float8 weight times its scale (scalar or [out, 1]) as float32."""
    scale = scale.float()
    if scale.numel() not in (1, weight.shape[0]):
        raise ValueError(f"weight_scale of {scale.numel()} values for {weight.shape[0]} rows")
    return weight.float() * scale.reshape(-1, 1)


def unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words -> their 32/bits unsigned fields along a new last axis, lowest first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def gptq_weight(qweight, qzeros, scales, g_idx, fmt: QuantFormat) -> torch.Tensor:
    """The dense [out, in] float32 weight of one GPTQ layer."""
    pack = 32 // fmt.bits
    q = unpack(qweight.to(torch.int32), fmt.bits)  # [in / pack, out, pack]
    q = q.permute(0, 2, 1).reshape(-1, qweight.shape[1])  # [in, out]
    zeros = unpack(qzeros.to(torch.int32), fmt.bits).reshape(qzeros.shape[0], -1)
    zeros = zeros + fmt.zero_offset  # [groups, out]
    num_in, num_out = q.shape
    if zeros.shape != scales.shape or scales.shape[1] != num_out:
        raise ValueError(
            f"gptq shapes disagree: qweight {tuple(qweight.shape)} (x{pack}), qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}"
        )
    if g_idx is None:
        size = fmt.group_size if fmt.group_size > 0 else num_in
        g_idx = torch.arange(num_in) // size
    g_idx = g_idx.long()
    if g_idx.shape != (num_in,) or int(g_idx.max()) >= scales.shape[0] or int(g_idx.min()) < 0:
        raise ValueError(f"g_idx must give each of {num_in} input rows one of "
                         f"{scales.shape[0]} groups")  # fmt: skip
    weight = (q - zeros[g_idx]).float() * scales.float()[g_idx]  # [in, out]
    return weight.t().contiguous()
