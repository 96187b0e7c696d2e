"""The CPU GEMM plan (pure): which packed format `auto` keeps from measured times, and the
row counts it serves, filled in between the measured ones."""

from __future__ import annotations

import pytest

from services.worker.models.gemm_plan import STATIC_ROWS, GemmPlan, choose_plan, static_plan

ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def _timings(plain, mkl, onednn):
    return {
        "plain": dict(zip(ROWS, plain, strict=True)),
        "mkl": dict(zip(ROWS, mkl, strict=True)),
        "onednn": dict(zip(ROWS, onednn, strict=True)),
    }


def test_the_format_saving_most_wins_and_serves_the_rows_it_beats_plain_at():
    # measured on an AVX2 EPYC (ms per step of a 32M model): oneDNN wins 2..64 rows
    plan = choose_plan(
        _timings(
            [7.7, 14.6, 22.9, 24.9, 24.4, 35.2, 40.4, 103.3],
            [9.1, 13.7, 22.3, 21.5, 23.4, 34.2, 39.7, 107.7],
            [8.9, 7.0, 8.9, 9.7, 12.9, 19.0, 31.2, 100.6],
        )
    )
    assert plan.packed_format == "onednn"
    assert plan.packed_rows == frozenset(range(2, 128))  # 1 and 128+ stay plain
    assert plan.summary() == {
        "packed_format": "onednn",
        "packed_rows": "2-127",
        "packed_row_count": 126,
        "packed_from": None,
    }
    assert not plan.serves(128) and not plan.serves(2048)


def test_gaps_between_measured_rows_follow_the_lower_measurement():
    plan = choose_plan(
        _timings(
            [10] * 8,
            [10] * 8,
            [12, 5, 5, 12, 5, 12, 12, 12],
        )
    )
    assert plan.packed_format == "onednn"
    assert plan.packed_rows == frozenset({2, 3, 4, 5, 6, 7, 16, *range(17, 32)})


def test_a_gain_inside_the_margin_keeps_plain_products():
    plan = choose_plan(_timings([10] * 8, [9.7] * 8, [9.9] * 8))
    assert plan.packed_format is None and plan.packed_rows == frozenset()
    assert plan.timings_us is not None  # what was measured stays on the plan


def test_mkl_wins_where_it_saves_more():
    plan = choose_plan(_timings([10] * 8, [5] * 4 + [11] * 4, [9] * 2 + [11] * 6))
    assert plan.packed_format == "mkl" and plan.packed_rows == frozenset(range(1, 16))


def test_tandems_panels_win_where_they_save_the_most():
    timings = _timings([10] * 8, [9] * 8, [6] * 8)
    timings["tandem"] = dict(zip(ROWS, [4, 4, 4, 4, 4, 5, 7, 11], strict=True))
    plan = choose_plan(timings)
    assert plan.packed_format == "tandem" and plan.packed_rows == frozenset(range(1, 128))
    assert static_plan("tandem").packed_rows == frozenset(STATIC_ROWS["tandem"])


def test_a_win_at_the_largest_count_measured_serves_every_larger_count():
    """Prompts: Tandem's panels beat plain at 128 rows, so 128 and up (any prompt size)
    take them; the counts below follow the measurements as before."""
    timings = _timings([10] * 8, [9] * 8, [12] * 8)
    timings["tandem"] = dict(zip(ROWS, [4, 4, 12, 4, 4, 5, 7, 8], strict=True))
    plan = choose_plan(timings)
    assert plan.packed_format == "tandem" and plan.packed_from == 128
    assert plan.packed_rows == frozenset({1, 2, 3, *range(8, 128)})
    assert [plan.serves(r) for r in (1, 3, 4, 7, 8, 127, 128, 2048, 100_000)] == [
        *(True, True, False, False),
        *(True,) * 5,
    ]
    assert plan.summary()["packed_from"] == 128
    named = static_plan("tandem")  # named, not measured: every row count
    assert all(named.serves(r) for r in (1, 64, 65, 4096))
    assert static_plan("onednn").packed_from is None and not static_plan("onednn").serves(65)


def test_a_missing_format_is_not_considered():
    timings = _timings([10] * 8, [1] * 8, [5] * 8)
    del timings["mkl"]
    assert choose_plan(timings).packed_format == "onednn"


def test_static_plans_and_validation():
    assert static_plan("mkl").packed_rows == frozenset(STATIC_ROWS["mkl"])
    assert 1 not in static_plan("mkl").packed_rows and 1 in static_plan("onednn").packed_rows
    with pytest.raises(ValueError, match="mkl, onednn"):
        static_plan("blas")
    with pytest.raises(ValueError, match="packed_format"):
        GemmPlan("blas", frozenset())
    with pytest.raises(ValueError, match="need a packed_format"):
        GemmPlan(None, frozenset({2}))
    with pytest.raises(ValueError, match="need a packed_format"):
        GemmPlan(None, frozenset(), packed_from=65)
    with pytest.raises(ValueError, match="packed_from must be"):
        GemmPlan("tandem", frozenset(), packed_from=0)
