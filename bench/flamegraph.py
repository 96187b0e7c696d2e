"""Collapsed stacks (py-spy's `raw` format: `frame;frame;... count` per line) as a
flame graph SVG, and the stacks themselves as a tree. Pure Python, no dependencies: each
frame is a rectangle as wide as its share of the samples, callers below callees, with the
frame, its sample count and share in a tooltip (`<title>`)."""

from __future__ import annotations

import html
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

ROW_PX = 16
WIDTH_PX = 1400
MIN_WIDTH_PX = 0.3  # narrower frames are dropped from the picture (not from the totals)


@dataclass
class Node:
    name: str
    count: int = 0
    children: dict[str, Node] = field(default_factory=dict)

    def depth(self) -> int:
        return 1 + max((c.depth() for c in self.children.values()), default=0)


def parse_collapsed(lines: Iterable[str]) -> list[tuple[list[str], int]]:
    stacks = []
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        stacks.append((stack.split(";"), int(count)))
    return stacks


def build_tree(stacks: Iterable[tuple[list[str], int]], root_name: str = "all") -> Node:
    root = Node(root_name)
    for frames, count in stacks:
        root.count += count
        node = root
        for frame in frames:
            node = node.children.setdefault(frame, Node(frame))
            node.count += count
    return root


def _color(name: str) -> str:
    h = zlib.crc32(name.encode())
    return f"rgb({205 + h % 50},{(h >> 8) % 180 + 50},{(h >> 16) % 55})"


def render_svg(root: Node, title: str) -> str:
    """The flame graph of `root` (samples), `title` on top."""
    depth = root.depth()
    height = (depth + 2) * ROW_PX
    scale = WIDTH_PX / max(root.count, 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH_PX}" height="{height}" '
        f'font-family="monospace" font-size="11">',
        f'<rect width="100%" height="100%" fill="#f8f8f8"/>'
        f'<text x="4" y="12">{html.escape(title)} ({root.count} samples)</text>',
    ]

    def draw(node: Node, x: float, level: int) -> None:
        width = node.count * scale
        if width < MIN_WIDTH_PX:
            return
        y = height - (level + 1) * ROW_PX
        share = 100.0 * node.count / max(root.count, 1)
        label = html.escape(node.name)
        parts.append(
            f"<g><title>{label} ({node.count} samples, {share:.1f}%)</title>"
            f'<rect x="{x:.1f}" y="{y}" width="{width:.1f}" height="{ROW_PX - 1}" '
            f'fill="{_color(node.name)}"/>'
        )
        chars = int(width / 7)
        if chars >= 4:
            text = node.name if len(node.name) <= chars else node.name[: chars - 2] + ".."
            parts.append(f'<text x="{x + 2:.1f}" y="{y + 11}">{html.escape(text)}</text>')
        parts.append("</g>")
        child_x = x
        for child in sorted(node.children.values(), key=lambda c: c.name):
            draw(child, child_x, level + 1)
            child_x += child.count * scale

    draw(root, 0.0, 0)
    parts.append("</svg>")
    return "\n".join(parts)
