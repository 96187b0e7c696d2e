"""The C++ CPU kernels (`kernels/cpu/*.cpp`) as torch ops (`torch.ops.tandem_cpu.*`).

They are compiled on first use with torch's extension builder (`-O3 -march=native`, OpenMP
through torch's own runtime, so they share its intra-op threads) into
`.tandem/build/torch_extensions/` and loaded from there afterwards (milliseconds; a source
change rebuilds). Building takes ~25 s once per machine; `make venv` does it ahead of time.
When no compiler is available the ops are missing and callers use their torch fallback:
`available()` says which, and why, once.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from common.log import get_logger

log = get_logger(__name__)

ROOT = Path(__file__).resolve().parents[1]
SOURCES = tuple(
    Path(__file__).resolve().parent / "cpu" / name
    for name in ("paged_decode_attention.cpp", "seeded_uniform.cpp")
)
BUILD_DIR = ROOT / ".tandem" / "build" / "torch_extensions"
NAME = "tandem_cpu_kernels"
# Set to 0 to never build or load the kernels (the torch fallbacks run instead).
ENV_SWITCH = "TANDEM_CPU_KERNELS"

_lock = threading.Lock()
_state: dict[str, object] = {}


def available() -> bool:
    """True once the ops are loaded (building them first if needed)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["why"] = _load()
            if _state["ok"]:
                log.info("cpu_kernels_loaded", name=NAME)
            else:
                log.warning("cpu_kernels_unavailable", reason=_state["why"])
        return bool(_state["ok"])


def _load() -> tuple[bool, str]:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False, f"{ENV_SWITCH}=0"
    if hasattr(torch.ops, "tandem_cpu") and hasattr(torch.ops.tandem_cpu, "seeded_uniform"):
        return True, ""
    try:
        from torch.utils.cpp_extension import load

        directory = BUILD_DIR / NAME
        directory.mkdir(parents=True, exist_ok=True)
        load(
            name=NAME,
            sources=[str(s) for s in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: fall back
        return False, f"{type(exc).__name__}: {str(exc)[-800:]}"
    return True, ""


def main() -> None:
    """`python -m kernels.cpu_ops`: build (or check) the kernels, exit 1 if unavailable."""
    ok = available()
    print(f"{NAME}: {'ready' if ok else 'unavailable: ' + str(_state['why'])}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
