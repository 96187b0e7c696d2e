"""`no_host_reads`: a context in which any read of a tensor's value into Python raises, for
checking that a kernel wrapper is CUDA-graph safe (no `.item()`, `.tolist()`, sync)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Make every way of reading a tensor's value into Python raise."""
    names = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    has_cuda = torch.cuda.is_available()

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a tensor value during a graph-safe launch")

    try:
        for name in names:
            setattr(torch.Tensor, name, forbidden)
        if has_cuda:
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        if has_cuda:
            torch.cuda.set_sync_debug_mode("default")
