"""GGUF files as models, as vLLM serves them: `--model path/file.gguf` (with `--tokenizer` for a
tokenizer folder other than the one the file carries).

A GGUF file is checked first (`inspect_gguf`): a valid file, an architecture Tandem serves,
and tensors of quant types the `gguf` package can dequantize; anything else is refused
with one line naming it. Then it is read once through transformers' GGUF support (the
`gguf` package dequantizes every tensor to float32, transformers maps llama.cpp's names
and layouts to its own) and written as an ordinary Hugging Face folder: `config.json`,
`generation_config.json`, the tokenizer, `model.safetensors`. Every service then loads
that folder as it loads any checkpoint. The folder lives in a cache keyed by the file's
SHA-256 (and the tokenizer folder), `.tandem/models/gguf/<digest>/<file stem>/` (or
`$TANDEM_GGUF_CACHE`), so the name clients see is the file's stem and a second start
costs one hash of the file. Services that start together build it once (a file lock).

Weights are dequantized, not kept quantized: on this CPU the float32 matmuls are what the
kernels are tuned for, and a Q4/Q8 kernel would have to beat them to be worth having.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE_ENV = "TANDEM_GGUF_CACHE"
SUFFIX = ".gguf"
COMPLETE = ".tandem-gguf.json"  # written last: the folder is whole
# GGUF `general.architecture` values Tandem serves (mistral's files say "llama").
ARCHITECTURES = ("llama", "qwen2", "qwen3")
_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GgufInfo:
    architecture: str
    name: str
    num_tensors: int
    quant_types: tuple[str, ...]
    head_dim: int | None  # `<arch>.attention.key_length`, when the file states it


def is_gguf(model: str | os.PathLike) -> bool:
    return str(model).lower().endswith(SUFFIX)


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or ROOT / ".tandem" / "models" / "gguf")


def resolve_model(model: str, tokenizer: str = "") -> str:
    """The folder to load for `--model`: the folder itself, or a GGUF file's converted
    folder (built on first use). `tokenizer` only applies to a GGUF file."""
    if not is_gguf(model):
        if tokenizer:
            raise ValueError("--tokenizer goes with a .gguf --model (a folder has its own)")
        return model
    return str(materialize(Path(model), tokenizer or None))


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def dequantizable_types() -> frozenset[str]:
    """Tensor types whose values the `gguf` package can read back as floats."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    names = {"F32", "F16", "BF16"}
    for qtype in GGMLQuantizationType:
        block, size = GGML_QUANT_SIZES.get(qtype, (0, 0))
        if qtype.name in names or not size or qtype.name.startswith(("I8", "I16", "I32", "I64")):
            continue
        try:
            dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, KeyError):
            continue
        names.add(qtype.name)
    return frozenset(names)


def inspect_gguf(path: Path) -> GgufInfo:
    """What the file holds; ValueError (one line, naming the problem) when it is not a
    GGUF file Tandem can serve."""
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    with open(path, "rb") as handle:
        if handle.read(4) != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        architecture = _field_str(reader, "general.architecture")
        name = _field_str(reader, "general.name", default="")
        key_length = reader.fields.get(f"{architecture}.attention.key_length")
        head_dim = int(key_length.parts[key_length.data[0]][0]) if key_length else None
        tensors = list(reader.tensors)
    except ValueError as exc:
        if "GGMLQuantizationType" in str(exc):
            raise ValueError(f"{path}: a tensor has an unknown quant type ({exc})") from None
        if "reshape" in str(exc):  # a tensor's data runs past the end of the file
            raise ValueError(f"{path}: truncated or corrupt ({_one_line(exc)})") from None
        raise ValueError(f"{path}: not a valid GGUF file ({_one_line(exc)})") from None
    except (IndexError, KeyError, OSError, TypeError, EOFError) as exc:
        raise ValueError(f"{path}: not a valid GGUF file ({_one_line(exc)})") from None
    size = path.stat().st_size
    for tensor in tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ValueError(
                f"{path}: truncated: tensor {tensor.name} ends at byte "
                f"{tensor.data_offset + tensor.n_bytes}, the file has {size}"
            )
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"{path}: architecture {architecture!r} is not served (Tandem serves GGUF files "
            f"of {', '.join(ARCHITECTURES)})"
        )
    types = sorted({t.tensor_type.name for t in tensors})
    readable = dequantizable_types()
    unreadable = [t for t in types if t not in readable]
    if unreadable:
        raise ValueError(
            f"{path}: quant type {', '.join(unreadable)} cannot be dequantized by the gguf "
            f"package (readable: {', '.join(sorted(readable))})"
        )
    return GgufInfo(architecture, name, len(tensors), tuple(types), head_dim)


def materialize(path: Path, tokenizer: str | None = None, out: Path | None = None) -> Path:
    """The converted folder of GGUF file `path` (built now unless it is complete already):
    `out`, or its place in the cache."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    digest = file_sha256(path)
    if out is None:
        key = digest[:16]
        if tokenizer:
            key += "-" + hashlib.sha256(str(Path(tokenizer).resolve()).encode()).hexdigest()[:8]
        out = cache_root() / key / path.stem
    out = Path(out)
    if _complete(out, digest):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / f".{out.name}.lock"):
        if _complete(out, digest):
            return out
        info = inspect_gguf(path)
        staging = out.parent / f".{out.name}.building-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _convert(path, tokenizer, staging, info.head_dim)
            _check_served(staging, path)
            record = {"gguf": str(path), "sha256": digest, "tokenizer": tokenizer or "gguf"}
            record.update(architecture=info.architecture, quant_types=list(info.quant_types))
            (staging / COMPLETE).write_text(json.dumps(record, indent=1) + "\n")
            shutil.rmtree(out, ignore_errors=True)
            os.replace(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out


def _convert(path: Path, tokenizer: str | None, out: Path, head_dim: int | None) -> None:
    """Dequantize `path` (float32) into a Hugging Face folder at `out`. `head_dim`: the
    file's key length (transformers does not read it for every architecture: Qwen3's
    config would otherwise keep its default of 128)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        if head_dim and getattr(config, "head_dim", head_dim) != head_dim:
            config.head_dim = head_dim
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, config=config, dtype=torch.float32
        )
        tok = (
            AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
            if tokenizer
            else AutoTokenizer.from_pretrained(folder, gguf_file=name)
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ValueError(f"{path}: transformers cannot read it: {_one_line(exc)}") from None
    # A plain checkpoint now: its weights are float32 tensors, nothing GGUF about them.
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.dtype = torch.float32
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _check_served(folder: Path, path: Path) -> None:
    """The converted checkpoint is one Tandem's model code takes."""
    from common.model_config import ModelConfig

    try:
        ModelConfig.from_folder(folder)
    except ValueError as exc:
        raise ValueError(f"{path}: {_one_line(exc)}") from None


def _complete(out: Path, digest: str) -> bool:
    marker = out / COMPLETE
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("sha256") == digest
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _field_str(reader, key: str, default: str | None = None) -> str:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"metadata field {key!r} is missing")
        return default
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
