"""Stop strings found in streamed text, whatever the token boundaries.

The matcher sees the output text as deltas. It emits text as soon as it cannot be the start
of a stop string, and holds back the longest tail that still could be (so a client never
sees text that a later match would cut). The match that ends first wins (ties: the one that
starts first), which is also what a matcher fed the text one character at a time would find,
so the result does not depend on how the text was split. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    stop: str
    text: str  # the text to emit before the stream ends (cut before or after the match)


class StopStringMatcher:
    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._include = include_stop_str_in_output
        self._held = ""

    @property
    def held(self) -> str:
        """Text held back because it could be the start of a stop string."""
        return self._held

    def feed(self, delta: str) -> tuple[str, StopMatch | None]:
        """Add text; return (text safe to emit now, the match if a stop string completed)."""
        if not self._stops:
            return delta, None
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            end = start + len(stop) if self._include else start
            self._held = ""
            return "", StopMatch(stop, text[:end])
        keep = self._longest_partial_tail(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """The generation ended without a match: release the held-back text."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _longest_partial_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
