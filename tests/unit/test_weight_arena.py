"""The packed weights' huge-page arena: copies in one advised mapping, and a model's
Tandem-packed weights living there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.models.weight_arena import ALIGN, WeightArena

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vma_of(address: int) -> dict[str, int]:
    """The smaps fields (kB) of this process's mapping that holds `address`."""
    fields: dict[str, int] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = start <= address < end
        elif inside and line.split()[-1] == "kB":
            fields[head.rstrip(":")] = int(line.split()[1])
    return fields


def test_views_hold_copies_aligned_and_independent():
    weights = [torch.randn(64, 48), torch.randn(3, 5), torch.randn(7), torch.randn(16, 2, 4)]
    arena = WeightArena(weights)
    assert len(arena.views) == len(weights)
    for w, view in zip(weights, arena.views, strict=True):
        assert view.shape == w.shape and view.dtype == w.dtype and view.is_contiguous()
        assert torch.equal(view, w)
        assert view.data_ptr() % ALIGN == 0
    # Copies, not aliases: the originals can go (or change) and the views stay.
    expected = arena.views[0].clone()
    weights[0].zero_()
    del weights
    assert torch.equal(arena.views[0], expected)
    # Back to back: each view starts where the one before it ends, rounded up to ALIGN.
    ends = [v.data_ptr() + v.numel() * v.element_size() for v in arena.views]
    starts = [v.data_ptr() for v in arena.views]
    assert all(s == -(-e // ALIGN) * ALIGN for e, s in zip(ends, starts[1:], strict=False))
    assert arena.num_bytes == sum(-(-(v.numel() * 4) // ALIGN) * ALIGN for v in arena.views)


def test_nothing_to_hold_and_bad_weights():
    assert WeightArena([]).views == [] and WeightArena([]).num_bytes == 0
    with pytest.raises(ValueError, match="contiguous"):
        WeightArena([torch.randn(8, 8).t()])


def test_weights_get_huge_pages_where_the_host_allows_them():
    mode = THP.read_text() if THP.exists() else "[never]"
    if "[never]" in mode:
        pytest.skip(f"transparent huge pages are off on this host ({mode.strip()})")
    arena = WeightArena([torch.randn(4 << 20)])  # 16 MiB: at least 7 whole 2 MiB pages
    assert arena.huge_pages_advised
    assert _vma_of(arena.views[0].data_ptr())["AnonHugePages"] >= 7 * 2048


def test_tandem_packed_model_weights_live_in_the_arena(tiny_llama_dir):
    from kernels import cpu_ops
    from services.worker.models.linear import MergedLinear
    from services.worker.models.weight_loader import load_model

    if not cpu_ops.available():
        pytest.skip("Tandem's CPU kernels did not build here")
    model, _ = load_model(tiny_llama_dir, torch.float32)
    packed_bytes, plan = model.pack_weights("tandem")
    layers = [m for m in model.modules() if isinstance(m, MergedLinear) and m.packed is not None]
    arena = model.weight_arena
    assert plan.packed_format == "tandem" and layers and arena is not None
    assert [m.packed.data_ptr() for m in layers] == [v.data_ptr() for v in arena.views]
    assert packed_bytes == sum(m.packed.numel() * 4 for m in layers) <= arena.num_bytes
    for m in layers:  # the panels in the arena are the kernel's own packing of the weight
        assert torch.equal(m.packed, torch.ops.tandem_cpu.pack_linear_weight(m.weight))


def test_other_formats_keep_their_own_memory(tiny_llama_dir):
    from services.worker.models.weight_loader import load_model

    model, _ = load_model(tiny_llama_dir, torch.float32)
    model.pack_weights("onednn")
    assert model.weight_arena is None
