"""Quantized checkpoints: which formats load, their linear layers gathered module by module
as they are read (never the whole model at once), and how they run.

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
formats, other bit widths) is refused at start, naming it.

How the layers run is the worker's `--quantized-matmul` (`TANDEM_QUANTIZED_MATMUL`,
`packed_matmul`):
- `dense`: each layer is dequantized to a dense weight in the model's dtype as it is read,
  then goes through the usual path (tensor-parallel slicing, merged projections, MKL's
  packed matmuls on CPU);
- `triton`: the layers stay packed on the device (`QuantizedWeight`, then
  `quantized_linear.QuantizedLinear`) and multiply through the Triton quantized matmuls of
  `kernels/quant_matmul.py`; one process only (tensor parallelism, and LoRA adapters, are
  refused); on CPU only under the Triton interpreter (`TRITON_INTERPRET=1`: tests);
- `auto` (default): `triton` on a CUDA device without tensor parallelism, else `dense`.
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


MATMUL_SETTING = "quantized_matmul"
MATMUL_CHOICES = ("auto", "triton", "dense")


def packed_matmul(
    fmt: QuantFormat | None, device: torch.device, tp_size: int = 1, choice: str = "auto"
) -> bool:
    """Whether quantized layers stay packed for the Triton matmul (`choice`: the worker's
    --quantized-matmul, module docstring); ValueError for a choice that cannot run here,
    naming the limit."""
    if choice not in MATMUL_CHOICES:
        choices = ", ".join(MATMUL_CHOICES)
        raise ValueError(f"{MATMUL_SETTING}={choice!r}: expected one of {choices}")
    if fmt is None or choice == "dense":
        return False
    if choice == "auto":
        return device.type == "cuda" and tp_size == 1
    if tp_size > 1:
        raise ValueError(
            f"{MATMUL_SETTING}=triton does not slice packed weights for --tensor-parallel-size "
            f"> 1 (got {tp_size}); use {MATMUL_SETTING}=dense (or auto) to load them dequantized"
        )
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{MATMUL_SETTING}=triton on {device.type} runs only under the Triton interpreter "
            f"(TRITON_INTERPRET=1, for tests); use {MATMUL_SETTING}=dense"
        )
    return True


@dataclass
class QuantizedWeight:
    """One quantized linear layer's checkpoint tensors as read (`parts`: by suffix, e.g.
    `qweight`), standing in for its dense `X.weight`."""

    fmt: QuantFormat
    module: str
    parts: dict[str, torch.Tensor]

    @property
    def shape(self) -> tuple[int, int]:
        """The dense weight's (out, in)."""
        if self.fmt.method == "fp8":
            return tuple(self.parts["weight"].shape)
        qweight = self.parts["qweight"]
        return (qweight.shape[1], qweight.shape[0] * (32 // self.fmt.bits))

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense `[out, in]` weight in `dtype`."""
        parts = self.parts
        if self.fmt.method == "fp8":
            return fp8_weight(parts["weight"], parts["weight_scale"]).to(dtype)
        return gptq_weight(
            parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), self.fmt
        ).to(dtype)

    def to(self, device: torch.device) -> QuantizedWeight:
        moved = {name: part.to(device) for name, part in self.parts.items()}
        return QuantizedWeight(self.fmt, self.module, moved)


def quantized_layers(
    tensors: Iterable[tuple[str, torch.Tensor]], fmt: QuantFormat | None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with every quantized linear layer as one `QuantizedWeight`
    named `X.weight` (yielded once its parts are all read); other tensors pass through."""
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
            if _complete(fmt, module, pending[module], final=False):
                yield f"{module}.weight", QuantizedWeight(fmt, module, pending.pop(module))
            continue
        yield name, tensor
    for module, parts in pending.items():  # g_idx-less GPTQ modules end here
        _complete(fmt, module, parts, final=True)
        yield f"{module}.weight", QuantizedWeight(fmt, module, parts)


def dequantized(
    tensors: Iterable[tuple[str, torch.Tensor]], fmt: QuantFormat | None, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """`quantized_layers` with each quantized layer as its dense `X.weight` in `dtype`."""
    for name, tensor in quantized_layers(tensors, fmt):
        yield name, tensor.dense(dtype) if isinstance(tensor, QuantizedWeight) else tensor


def _quantized(fmt: QuantFormat, module: str, part: str, tensor: torch.Tensor) -> bool:
    if fmt.method == "gptq":
        return True
    if module.split(".")[-1] in fmt.ignore or module in fmt.ignore:
        return False
    return part != "weight" or tensor.dtype == torch.float8_e4m3fn


def _complete(fmt: QuantFormat, module: str, parts: dict, final: bool) -> bool:
    """Whether `parts` hold the whole layer; at the `final` check a layer that does not is
    a ValueError naming what it lacks."""
    if fmt.method == "fp8":
        if "weight" in parts and "weight_scale" in parts:
            return True
        if final:
            raise ValueError(f"{module}: an FP8 weight needs weight and weight_scale")
        return False
    if not final:
        return len(parts) == len(GPTQ_PARTS)
    missing = [p for p in GPTQ_PARTS[:3] if p not in parts]
    if missing:
        raise ValueError(f"{module}: a gptq layer needs {', '.join(GPTQ_PARTS[:3])}; missing "
                         f"{missing}")  # fmt: skip
    return True


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[out, in] float8 weight times its scale (scalar or [out, 1]) as float32."""
    scale = scale.float()
    if scale.numel() not in (1, weight.shape[0]):
        raise ValueError(f"weight_scale of {scale.numel()} values for {weight.shape[0]} rows")
    return weight.float() * scale.reshape(-1, 1)


def unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words -> their 32/bits unsigned fields along a new last axis, lowest first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    return (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def gptq_weight(qweight, qzeros, scales, g_idx, fmt: QuantFormat) -> torch.Tensor:
    """The dense [out, in] float32 weight of one GPTQ layer."""
    q = unpack(qweight.to(torch.int32), fmt.bits)  # [in / pack, out, pack]
    q = q.permute(0, 2, 1).reshape(-1, qweight.shape[1])  # [in, out]
    zeros = unpack(qzeros.to(torch.int32), fmt.bits).reshape(qzeros.shape[0], -1)
    zeros = zeros + fmt.zero_offset  # [groups, out]
    g_idx = gptq_groups(qweight, qzeros, scales, g_idx, fmt)
    weight = (q - zeros[g_idx]).float() * scales.float()[g_idx]  # [in, out]
    return weight.t().contiguous()


def gptq_groups(qweight, qzeros, scales, g_idx, fmt: QuantFormat) -> torch.Tensor:
    """Each input row's group (int64 `[in]`, from `g_idx` or the group size), once the
    layer's shapes and `g_idx` are checked (ValueError naming the disagreement)."""
    pack = 32 // fmt.bits
    num_in, num_out = qweight.shape[0] * pack, qweight.shape[1]
    if qzeros.shape[1] * pack != num_out or tuple(scales.shape) != (qzeros.shape[0], num_out):
        raise ValueError(
            f"gptq shapes disagree: qweight {tuple(qweight.shape)} (x{pack}), qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}"
        )
    if g_idx is None:
        size = fmt.group_size if fmt.group_size > 0 else num_in
        g_idx = torch.arange(num_in, device=qweight.device) // size
    g_idx = g_idx.long()
    if g_idx.shape != (num_in,) or int(g_idx.max()) >= scales.shape[0] or int(g_idx.min()) < 0:
        raise ValueError(f"g_idx must give each of {num_in} input rows one of "
                         f"{scales.shape[0]} groups")  # fmt: skip
    return g_idx
