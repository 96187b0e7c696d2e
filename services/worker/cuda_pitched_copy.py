"""One asynchronous strided copy between a CUDA pool and page-locked host memory:
`cudaMemcpy2DAsync` from the CUDA runtime torch loaded, called through ctypes.

A layer slot of a run of consecutive blocks is `rows` equal spans (one per block) a block
apart, in the pool and in the host tier alike. torch has no asynchronous copy of such a
view between host and device: `Tensor.copy_` of a non-contiguous host tensor first gathers
it into pageable memory on the CPU (ATen's `copy_requires_temporaries`), synchronously,
and a copy per block per layer costs a Python call each (hundreds a step). The runtime's
pitched copy moves the whole run in one call, queued on the given stream, and runs
asynchronously when the host side is page-locked.

`pitched_copy()` is None where no CUDA runtime with that symbol is found (no GPU build, a
runtime linked statically): callers then copy whole blocks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

import torch

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the pointers (UVA)

PitchedCopy = Callable[[torch.Tensor, torch.Tensor, torch.cuda.Stream], None]


def _runtime_paths() -> list[str]:
    """The CUDA runtimes already mapped into this process (torch's own), then the one the
    loader would find by name."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libcudart" in path.rsplit("/", 1)[-1] and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    found = ctypes.util.find_library("cudart")
    if found is not None:
        paths.append(found)
    return paths


@functools.cache
def pitched_copy() -> PitchedCopy | None:
    """`copy(dst, src, stream)`: `dst[r] = src[r]` for each row of two `[rows, width]` uint8
    views whose rows are contiguous (any row stride), queued on `stream`; None when the
    CUDA runtime cannot be found."""
    if not torch.cuda.is_available():
        return None
    for path in _runtime_paths():
        try:
            runtime = ctypes.CDLL(path)
            memcpy = runtime.cudaMemcpy2DAsync
            error_string = runtime.cudaGetErrorString
        except (OSError, AttributeError):
            continue
        size = ctypes.c_size_t
        memcpy.argtypes = [ctypes.c_void_p, size, ctypes.c_void_p, size, size, size]
        memcpy.argtypes += [ctypes.c_int, ctypes.c_void_p]
        memcpy.restype = ctypes.c_int
        error_string.argtypes, error_string.restype = [ctypes.c_int], ctypes.c_char_p
        return functools.partial(_copy, memcpy, error_string)
    return None


def _copy(memcpy, error_string, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
    if dst.dim() != 2 or dst.shape != src.shape or dst.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError(f"pitched copy needs two equal [rows, width] views, got {dst.shape}")
    if dst.dtype != torch.uint8 or src.dtype != torch.uint8:
        raise ValueError("pitched copy moves uint8 views")
    rows, width = src.shape
    if rows == 0:
        return
    status = memcpy(
        dst.data_ptr(), dst.stride(0), src.data_ptr(), src.stride(0), width, rows,
        MEMCPY_DEFAULT, stream.cuda_stream,
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync failed: {error_string(status).decode()}")
