"""Tool-call parsers by vLLM's `--tool-call-parser` names (one module per format; the
forced-call parsing of tool_choice `required` / named is `forced.py`). Pure."""

from __future__ import annotations

from services.gateway.tool_parsers.base import ToolParser
from services.gateway.tool_parsers.hermes import HermesParser
from services.gateway.tool_parsers.llama3_json import Llama3JsonParser
from services.gateway.tool_parsers.mistral import MistralParser

# vLLM's names; `qwen3_json` is vLLM's alias of hermes (Qwen2.5 / Qwen3 JSON calls).
TOOL_PARSERS: dict[str, type] = {
    "hermes": HermesParser,
    "qwen3_json": HermesParser,
    "llama3_json": Llama3JsonParser,
    "llama4_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def tool_parser(name: str) -> ToolParser:
    """The parser called `name` (ValueError naming the known ones otherwise)."""
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}"
        )
    return TOOL_PARSERS[name]()
