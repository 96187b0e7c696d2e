"""The tool-calling stack's settings, shared by the modules that call it
(`tests/service/test_tool_calling.py`, `test_agent_api_tools.py`) through the session's
`tool_stack` fixture: the tool checkpoint's model name, the gateway's tool and reasoning
flags, and the logit_bias that steers its random model through constrained calls
(`</think>` first, so the grammar starts at once; no whitespace-only tokens, which a
structural tag's JSON would otherwise take forever)."""

from __future__ import annotations

from pathlib import Path

from devtools.tool_checkpoint import TOOL_TEMPLATE_PATH

MODEL = "qwen2-tools"
FLAGS = (
    "--chat-template", str(TOOL_TEMPLATE_PATH), "--enable-auto-tool-choice",
    "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1",
)  # fmt: skip
CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}
# Closed objects: a schema that allows more properties lets a random model add them forever.
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": CITY},
    "required": ["city"],
    "additionalProperties": False,
}


def think_end_id(model: Path) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model)).convert_tokens_to_ids("</think>")


def steering_bias(model: Path) -> dict[int, float]:
    """The logit_bias the constrained requests carry: `</think>` first, no whitespace."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    blank = [i for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()]
    steer = {think_end_id(model): 100.0}
    return steer | {i: -100.0 for i in blank if i not in tokenizer.all_special_ids}
