"""The quantized checkpoints `bench.quality` measures, made from the float SmolLM2 folder with
the libraries the field uses, under `.tandem/models/` (never committed; rebuilt when absent):

- FP8: `compressed-tensors` (the main virtualenv's), the `float-quantized` format vLLM and
  Tandem read: every decoder Linear's weight in float8 e4m3 with one scale per output
  channel (symmetric min-max, compressed-tensors' own `calculate_qparams`: what
  llm-compressor's FP8 weight observer computes), `lm_head` (tied to the embeddings) kept.
- GPTQ: `gptqmodel` (real GPTQ: Hessian-based error compensation over a calibration set),
  4 bits (symmetric, gptqmodel's default, and asymmetric) and 8 bits, groups of 32, the
  `gptq` checkpoint format, run on CPU in its own virtualenv
  (`.tandem/venvs/gptq`, made here: the main one must never get another torch). gptqmodel
  7.7.0 asks for torch>=2.14.1, and PyPI's Linux torch 2.14.1 is the CUDA build, so the
  virtualenv gets the main one's CPU torch, gptqmodel's other requirements, and gptqmodel
  itself with `--no-deps`. Calibration: `devtools/assets/corpus.txt` (the project's own
  text, not the held-out one), 64 chunks of 256 tokens.

    python -m bench.quality_weights [fp8] [gptq | gptq-4bit-g32 ...]  # build (or show)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / ".tandem" / "models"
GPTQ_VENV = ROOT / ".tandem" / "venvs" / "gptq"
CALIBRATION = ROOT / "devtools" / "assets" / "corpus.txt"
GPTQMODEL = "gptqmodel==7.7.0"
# (name, bits, group size, symmetric): gptqmodel's defaults at 4 bits, the asymmetric grid
# (like the Q4_1 GGUF the float model was dequantized from), and 8 bits.
GPTQ_VARIANTS = {
    "gptq-4bit-g32": (4, 32, True),
    "gptq-4bit-g32-asym": (4, 32, False),
    "gptq-8bit-g32": (8, 32, True),
}
CALIBRATION_CHUNKS, CALIBRATION_LEN = 64, 256


def _done(folder: Path) -> bool:
    return (folder / "config.json").exists() and any(folder.glob("*.safetensors"))


def build_fp8(source: Path, out: Path | None = None) -> Path:
    """Per-channel FP8 (float-quantized) compressed-tensors checkpoint of `source`."""
    out = out or MODELS / f"{source.name}-FP8-channel"
    if _done(out):
        return out
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    weights = QuantizationArgs(
        num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False
    )
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=["lm_head"],
    )
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None or scheme.weights is None:
                continue
            w = module.weight
            scale, zero = calculate_qparams(
                w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), scheme.weights
            )
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, "float-quantized")
    compressor.compress_model(model)
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial)
    compressor.update_config(str(partial))
    AutoTokenizer.from_pretrained(source).save_pretrained(partial)
    _copy_extras(source, partial)
    partial.rename(out)
    return out


def _copy_extras(source: Path, out: Path) -> None:
    for name in ("chat_template.jinja", "generation_config.json"):
        if (source / name).exists() and not (out / name).exists():
            (out / name).write_bytes((source / name).read_bytes())


def _pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *args], check=True)


def gptq_venv(venv: Path = GPTQ_VENV) -> Path:
    """The python of a virtualenv with gptqmodel on the main virtualenv's CPU torch."""
    python = venv / "bin" / "python"
    ok = venv / ".complete"
    if ok.exists():
        return python
    import torch

    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    _pip(venv, f"torch=={torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [str(venv / "bin" / "pip"), "download", "-q", "--no-deps", "--no-binary", ":all:",
             GPTQMODEL, "-d", tmp], check=True,
        )  # fmt: skip
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/requirements.txt"))
            reqs = tar.extractfile(member).read().decode().splitlines()
        keep = [r for r in reqs if r.strip() and not r.replace(" ", "").startswith("torch>")]
        (Path(tmp) / "reqs.txt").write_text("\n".join(keep) + "\n")
        (Path(tmp) / "pin.txt").write_text(f"torch=={torch.__version__}\n")
        _pip(venv, "-r", f"{tmp}/reqs.txt", "-c", f"{tmp}/pin.txt")
        _pip(venv, "--no-deps", str(sdist))
    ok.write_text(GPTQMODEL + "\n")
    return python


GPTQ_SCRIPT = """
import json, sys, time
import torch
from gptqmodel import GPTQModel, QuantizeConfig
from transformers import AutoTokenizer
source, out, bits, group, sym, chunks, length, corpus = sys.argv[1:9]
bits, group, chunks, length = int(bits), int(group), int(chunks), int(length)
torch.set_num_threads(2)
tok = AutoTokenizer.from_pretrained(source)
ids = tok(open(corpus).read())["input_ids"]
calibration = [{"input_ids": ids[i * length:(i + 1) * length],
                "attention_mask": [1] * length} for i in range(chunks)
               if len(ids) >= (i + 1) * length]
start = time.time()
config = QuantizeConfig(bits=bits, group_size=group, sym=sym == "1")
model = GPTQModel.load(source, config, device="cpu", dtype=torch.float32)
model.quantize(calibration, batch_size=1)
model.save(out)
tok.save_pretrained(out)
print(json.dumps({"quantize_s": round(time.time() - start, 1), "calibration_chunks":
      len(calibration), "quantize_config": json.load(open(out + "/config.json"))
      .get("quantization_config")}))
"""


def build_gptq(source: Path, variant: str = "gptq-4bit-g32") -> dict:
    """{"folder": path, ...} or {"error": why}: a GPTQ_VARIANTS checkpoint made with
    gptqmodel (module doc)."""
    bits, group, sym = GPTQ_VARIANTS[variant]
    out = MODELS / f"{source.name}-{variant.upper()}"
    info = out / "bench_quality_gptq.json"
    if _done(out) and info.exists():
        return {"folder": str(out), **json.loads(info.read_text())}
    try:
        python = gptq_venv()
    except subprocess.CalledProcessError as error:
        return {"error": f"could not make the gptqmodel virtualenv: {error}"}
    partial = out.with_name(out.name + ".partial")
    start = time.time()
    # gptqmodel sizes its CPU pool at (cpus + 1) // 2 workers, then asks 2 for its model
    # loader: on 2 CPUs that is "requests 2 workers but parent 'cpu' only has 1".
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": str(max(2, (os.cpu_count() or 1) // 2))}
    run = subprocess.run(
        [str(python), "-c", GPTQ_SCRIPT, str(source), str(partial), str(bits), str(group),
         str(int(sym)), str(CALIBRATION_CHUNKS), str(CALIBRATION_LEN), str(CALIBRATION)],
        capture_output=True, text=True, env=env, cwd=MODELS,  # its logs/ lands there
    )  # fmt: skip
    if run.returncode != 0:
        tail = (run.stderr or run.stdout).strip().splitlines()[-15:]
        return {"error": f"gptqmodel failed (exit {run.returncode}): " + "\n".join(tail)}
    record = json.loads(run.stdout.strip().splitlines()[-1])
    version = subprocess.run(
        [str(python), "-c", "import gptqmodel; print(gptqmodel.__version__)"],
        capture_output=True, text=True,
    ).stdout.strip().splitlines()  # fmt: skip
    record |= {"library": f"gptqmodel {version[-1] if version else '?'}",
               "wall_s": round(time.time() - start, 1)}  # fmt: skip
    _copy_extras(source, partial)
    (partial / info.name).write_text(json.dumps(record, indent=1))
    partial.rename(out)
    return {"folder": str(out), **record}


GPTQ_LOGPROBS_SCRIPT = """
import json, sys
import torch
from gptqmodel import GPTQModel
folder, windows = sys.argv[1], json.load(open(sys.argv[2]))
torch.set_num_threads(2)
model = GPTQModel.load(folder, device="cpu", dtype=torch.float32)
out = []
with torch.inference_mode():
    for tokens in windows:
        ids = torch.tensor([tokens])
        logits = model.model(ids).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
        out.append(lp.tolist())
json.dump({"backend": str(getattr(model, "backend", "?")), "logprobs": out}, sys.stdout)
"""


def gptq_reference_logprobs(folder: Path, windows: list[list[int]]) -> dict:
    """Each window's next-token log-probs from gptqmodel itself running the GPTQ checkpoint
    (its CPU kernels): {"logprobs": [...], "backend": ...} or {"error": why}."""
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": str(max(2, (os.cpu_count() or 1) // 2))}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(windows, f)
        f.flush()
        run = subprocess.run(
            [str(gptq_venv()), "-c", GPTQ_LOGPROBS_SCRIPT, str(folder), f.name],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
    if run.returncode != 0:
        return {"error": "\n".join((run.stderr or run.stdout).strip().splitlines()[-10:])}
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    from devtools.default_model import build

    which = sys.argv[1:] or ["fp8", "gptq"]
    source = build()
    if "fp8" in which:
        print("fp8:", build_fp8(source))
    for variant in GPTQ_VARIANTS:
        if "gptq" in which or variant in which:
            print(f"{variant}:", json.dumps(build_gptq(source, variant), indent=1))


if __name__ == "__main__":
    main()
