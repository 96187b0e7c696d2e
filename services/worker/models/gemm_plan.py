"""The plan of which CPU matrix product multiplies float32 activations by a linear layer's
weight at each row count (pure: no torch). `cpu_gemm.py` measures and runs it.

A plan keeps at most one packed format (MKL's, oneDNN's or Tandem's blocked copy of the
weight) and the row counts where that format beats the plain product (decode batches), plus,
where it also beat it at the largest count measured, every count from there up (prompts);
every other row count runs `torch.mm` on the transposed weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

FORMATS = ("mkl", "onednn", "tandem")
CHOICES = ("auto", *FORMATS)
# Row counts timed by `auto`; a row count between two of them takes the lower one's choice,
# and the last one's choice holds for every count above it (prompts: Tandem's panels run
# them with their own loop order, 7-28% faster than `torch.mm` on the EPYC; on the Xeon
# MKL's packed GEMM lost from 64).
MEASURED_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
# Rows a named format is used for without measuring (MKL's range was measured on a Xeon),
# and where a named format also takes every larger count.
STATIC_ROWS = {"mkl": range(2, 33), "onednn": range(1, 65), "tandem": range(1, 65)}
STATIC_FROM = {"tandem": 65}
# A packed format must beat the plain product by this factor at a row count to be used there:
# a smaller gain is inside the noise of a measurement at load.
MARGIN = 0.95
# `measure` times the first weights up to this many bytes: past the last-level cache, so the
# products stream their weights from memory as a decode step does, but bounded for big models.
MEASURE_BYTES = 96 * 2**20


@dataclass(frozen=True)
class GemmPlan:
    """The packed format kept (None: plain products only) and the row counts it serves."""

    packed_format: str | None
    packed_rows: frozenset[int]
    timings_us: Mapping[str, Mapping[int, float]] | None = None  # what `auto` measured
    packed_from: int | None = None  # every row count from this one up is packed too

    def __post_init__(self) -> None:
        if self.packed_format is not None and self.packed_format not in FORMATS:
            raise ValueError(f"packed_format must be one of {', '.join(FORMATS)}")
        if self.packed_format is None and (self.packed_rows or self.packed_from is not None):
            raise ValueError("packed_rows and packed_from need a packed_format")
        if self.packed_from is not None and self.packed_from < 1:
            raise ValueError("packed_from must be >= 1")

    def serves(self, rows: int) -> bool:
        """Whether `rows` rows take the packed product."""
        return rows in self.packed_rows or (
            self.packed_from is not None and rows >= self.packed_from
        )

    def summary(self) -> dict:
        rows = sorted(self.packed_rows)
        return {
            "packed_format": self.packed_format,
            "packed_rows": f"{rows[0]}-{rows[-1]}" if rows else "",
            "packed_row_count": len(rows),
            "packed_from": self.packed_from,
        }


PLAIN = GemmPlan(None, frozenset())


def static_plan(fmt: str) -> GemmPlan:
    if fmt not in FORMATS:
        raise ValueError(f"cpu gemm format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return GemmPlan(fmt, frozenset(STATIC_ROWS[fmt]), packed_from=STATIC_FROM.get(fmt))


def choose_plan(timings: Mapping[str, Mapping[int, float]], margin: float = MARGIN) -> GemmPlan:
    """From seconds (or any unit) per product chain, keyed `plain` and by format, then by row
    count: the format whose best use saves the most time over the measured row counts, and
    the row counts (filled in between measured ones) where it wins by `margin`."""
    plain = timings["plain"]
    rows = sorted(plain)
    best: tuple[float, str] | None = None
    for fmt in FORMATS:
        if fmt not in timings:
            continue
        # time relative to plain, so the small-row counts (decode) weigh as much as the big
        saved = sum(
            1.0 - timings[fmt][r] / plain[r] for r in rows if timings[fmt][r] < margin * plain[r]
        )
        if saved > 0 and (best is None or saved > best[0]):
            best = (saved, fmt)
    if best is None:
        return GemmPlan(None, frozenset(), timings)
    fmt = best[1]
    wins = {r for r in rows if timings[fmt][r] < margin * plain[r]}
    served = set()
    for low, high in zip(rows, rows[1:], strict=False):
        if low in wins:
            served.update(range(low, high))
    packed_from = rows[-1] if rows[-1] in wins else None
    return GemmPlan(fmt, frozenset(served), timings, packed_from)
