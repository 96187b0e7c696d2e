"""The C++ CPU kernels (`kernels/cpu/*.cpp`) as torch ops (`torch.ops.tandem_cpu.*`).

They are compiled on first use with torch's extension builder (`-O3 -march=native`, OpenMP
through torch's own runtime, so they share its intra-op threads) into a folder under
`.tandem/build/torch_extensions/` named by a hash of the sources, flags and torch version
(a change builds anew), and later loaded straight from the shared library there
(milliseconds). Building takes ~30 s once per machine (two units, `UNITS`, compiled in
parallel); `make venv` does it ahead of time.
Concurrent first uses build once: the build holds an `flock` (released by the kernel if
the builder dies, unlike the extension builder's own lock file, which a killed build
leaves behind and every later build would wait on forever: a stale one is removed). When
no compiler is available the ops are missing and callers use their torch fallback:
`available()` says which, and why, once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
from pathlib import Path

import torch

from common.log import get_logger

log = get_logger(__name__)

ROOT = Path(__file__).resolve().parents[1]
SOURCES = tuple(
    Path(__file__).resolve().parent / "cpu" / name
    for name in (
        "gumbel_race.cpp",
        "packed_linear.cpp",
        "paged_decode_attention.cpp",
        "rms_norm.cpp",
        "rotary_write.cpp",
        "seeded_uniform.cpp",
        "silu_and_mul.cpp",
    )
)
# Headers the sources include (hashed with them: a change builds anew).
HEADERS = tuple(
    Path(__file__).resolve().parent / "cpu" / name
    for name in (
        "claimed_parallel.h",
        "counter_hash.h",
        "packed_microkernel.h",
        "quant_panels.h",
        "row_parallel.h",
        "vec_exp.h",
    )
)
# What the compiler is given: two units, each including three or four of SOURCES (torch's
# headers parsed twice rather than seven times; the units build in parallel).
UNITS = tuple(
    Path(__file__).resolve().parent / "cpu" / name
    for name in ("unit_linear_attention.cpp", "unit_sampling_norm.cpp")
)
BUILD_DIR = ROOT / ".tandem" / "build" / "torch_extensions"
NAME = "tandem_cpu_kernels"
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# Set to 0 to never build or load the kernels (the torch fallbacks run instead).
ENV_SWITCH = "TANDEM_CPU_KERNELS"

_lock = threading.Lock()
_state: dict[str, object] = {}


def available() -> bool:
    """True once the ops are loaded (building them first if needed)."""
    if "ok" in _state:  # decided (asked per forward pass and per sampler draw)
        return bool(_state["ok"])
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["why"] = _load()
            if _state["ok"]:
                log.info("cpu_kernels_loaded", name=NAME)
            else:
                log.warning("cpu_kernels_unavailable", reason=_state["why"])
        return bool(_state["ok"])


def build_directory() -> Path:
    """Where this exact build (sources, flags, torch version) lives."""
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS + UNITS:
        digest.update(source.read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    return BUILD_DIR / f"{NAME}-{digest.hexdigest()[:16]}"


def _load() -> tuple[bool, str]:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False, f"{ENV_SWITCH}=0"
    if hasattr(torch.ops, "tandem_cpu") and hasattr(torch.ops.tandem_cpu, "seeded_uniform"):
        return True, ""
    try:
        directory = build_directory()
        library = directory / f"{NAME}.so"
        if not library.is_file():
            _build(directory)
        if not hasattr(torch.ops.tandem_cpu, "seeded_uniform"):
            torch.ops.load_library(str(library))
    except Exception as exc:  # no compiler, no ninja, a failed build: fall back
        return False, f"{type(exc).__name__}: {str(exc)[-800:]}"
    return True, ""


def _build(directory: Path) -> None:
    """Build into `directory` once, whoever else is trying at the same time."""
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{directory.name}.build-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (directory / f"{NAME}.so").is_file():
            return  # another process built it while this one waited
        (directory / "lock").unlink(missing_ok=True)  # a killed build's stale baton
        load(
            name=NAME,
            sources=[str(s) for s in UNITS],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )


def main() -> None:
    """`python -m kernels.cpu_ops`: build (or check) the kernels, exit 1 if unavailable."""
    ok = available()
    print(f"{NAME}: {'ready' if ok else 'unavailable: ' + str(_state['why'])}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
