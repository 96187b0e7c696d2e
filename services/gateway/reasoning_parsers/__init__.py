"""Reasoning parsers by vLLM's `--reasoning-parser` names. Pure."""

from __future__ import annotations

from services.gateway.reasoning_parsers.think import ThinkFormat

REASONING_PARSERS: dict[str, ThinkFormat] = {
    "deepseek_r1": ThinkFormat(),
    "qwen3": ThinkFormat(implicit_ends=("<tool_call>",)),
}


def reasoning_parser(name: str) -> ThinkFormat:
    """The parser called `name` (ValueError naming the known ones otherwise)."""
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}"
        )
    return REASONING_PARSERS[name]
