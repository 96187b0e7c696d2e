"""Stop strings in streamed text: found across any split, never shown before a cut, and the
match that ends first wins."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.stop_strings import StopStringMatcher


def run(stops, pieces, include=False):
    """(emitted text, matched stop or None, every emitted chunk)."""
    matcher = StopStringMatcher(stops, include)
    chunks = []
    for piece in pieces:
        safe, match = matcher.feed(piece)
        chunks.append(safe)
        if match is not None:
            chunks.append(match.text)
            return "".join(chunks), match.stop, chunks
    chunks.append(matcher.flush())
    return "".join(chunks), None, chunks


def one_shot(stops, text, include=False):
    """The reference: the earliest-ending match over the whole text."""
    best = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    if best is None:
        return text, None
    end, start, stop = best
    return text[: end if include else start], stop


def test_stop_string_split_across_pieces_is_cut_and_never_shown():
    text, stop, chunks = run(["\n\nUser:"], ["Hello", " there\n", "\nUs", "er:", " more"])
    assert (text, stop) == ("Hello there", "\n\nUser:")
    assert chunks[:2] == ["Hello", " there"]  # "\n" held back: it may start the stop string


def test_include_stop_string_keeps_it():
    assert run(["END"], ["abc E", "N", "D tail"], include=True)[:2] == ("abc END", "END")


def test_earliest_ending_match_wins_and_ties_go_to_the_earlier_start():
    assert run(["bcd", "c"], ["abcd"])[:2] == ("ab", "c")
    assert run(["abc", "bc"], ["xabc"])[:2] == ("x", "abc")


def test_text_without_a_match_is_released_in_full_at_the_end():
    text, stop, chunks = run(["STOP"], ["go ST", "O"])
    assert (text, stop) == ("go STO", None)
    assert chunks[-1] == "STO"  # held until flush


def test_no_stop_strings_is_a_pass_through():
    assert run([], ["a", "b"])[:2] == ("ab", None)


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\nc", max_size=40),
    stops=st.lists(st.text(alphabet="ab\nc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    include=st.booleans(),
)
def test_any_split_gives_the_one_shot_result_and_never_leaks_cut_text(text, stops, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    got, stop, chunks = run(stops, pieces, include)
    assert (got, stop) == one_shot(stops, text, include)
    shown = ""
    for chunk in chunks:
        shown += chunk
        assert got.startswith(shown)  # nothing emitted is ever taken back
