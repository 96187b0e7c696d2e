"""`<think>…</think>` reasoning (vLLM's `deepseek_r1` and `qwen3`): the output's reasoning
runs until `</think>` and what follows is content; an opening `<think>` is dropped, and
its absence changes nothing (DeepSeek-R1's template opens the block in the prompt). An
output that never closes the block is all reasoning. `qwen3` also ends reasoning where a
`<tool_call>` starts (Qwen3 may call a tool straight from its thinking). Streamed, a
tail that may be the start of a tag is held back until it is known (or the output ends).
Pure."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.tool_parsers.base import tag_overlap

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    reasoning: str | None
    content: str | None


@dataclass(frozen=True)
class ThinkFormat:
    """One `<think>` dialect: the tags, and the markers that end reasoning implicitly
    (they stay in the content)."""

    start: str = START
    end: str = END
    implicit_ends: tuple[str, ...] = ()

    def split(self, text: str) -> Split:
        """A whole output's reasoning and content (None when empty)."""
        before, tag, after = text.partition(self.start)
        text = after if tag else before
        cut, skip = self.reasoning_end(text)
        if cut < 0:
            return Split(text, None)
        return Split(text[:cut], text[cut + skip :] or None)

    def reasoning_end(self, text: str) -> tuple[int, int]:
        """Where reasoning ends in `text` and how many characters the end marker takes
        out of the content (-1: not yet)."""
        found = [(text.find(self.end), len(self.end))]
        found += [(text.find(m), 0) for m in self.implicit_ends]
        found = [f for f in found if f[0] >= 0]
        return min(found) if found else (-1, 0)

    def stream(self, ended: bool = False) -> ThinkStream:
        return ThinkStream(self, ended)

    def ends_in(self, text: str) -> bool:
        """Whether reasoning is closed at the end of `text` (a prompt: its last tag)."""
        return text.rfind(self.end) > text.rfind(self.start)


class ThinkStream:
    """One sample's stream: `feed` the whole text so far, get (reasoning, content) new
    since the previous call."""

    def __init__(self, fmt: ThinkFormat, ended: bool = False) -> None:
        self.fmt = fmt
        self.ended = ended  # True from the start: the prompt closed the block
        self.reasoning_sent = 0  # offsets in the text after an opening tag
        self.content_from: int | None = 0 if ended else None
        self.content_sent = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """`final`: the output ended, so nothing is held back."""
        if self.content_from is not None:
            piece, self.content_sent = text[self.content_sent :], len(text)
            return "", piece
        head = len(self.fmt.start) if text.startswith(self.fmt.start) else 0
        if not head and self.fmt.start.startswith(text) and not final:
            return "", ""  # may still become the opening tag
        body = text[head:]
        cut, skip = self.fmt.reasoning_end(body)
        if cut < 0:
            markers = (self.fmt.end, *self.fmt.implicit_ends)
            held = 0 if final else max(tag_overlap(body, m) for m in markers)
            end = len(body) - held
            piece = body[self.reasoning_sent : end] if end > self.reasoning_sent else ""
            self.reasoning_sent = max(self.reasoning_sent, end)
            return piece, ""
        reasoning = body[self.reasoning_sent : cut] if cut > self.reasoning_sent else ""
        self.reasoning_sent = cut
        self.ended = True
        self.content_from = head + cut + skip
        self.content_sent = len(text)
        return reasoning, text[self.content_from :]
