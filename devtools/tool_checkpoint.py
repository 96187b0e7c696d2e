"""A tiny random Qwen2 checkpoint whose tokenizer and chat template know tools and
reasoning: `<tool_call>`, `</tool_call>`, `<think>`, `</think>` as added (not special)
tokens, as in Qwen2.5/Qwen3 tokenizers, and `assets/tool_chat_template.jinja` (Qwen's
Hermes-style tool prompt: tools listed in `<tools>`, calls as
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, results as `<tool_response>`) as
its chat template. vLLM's hermes tool parser and its deepseek_r1/qwen3 reasoning parsers
look these tokens up in the vocabulary, so the same folder serves both servers of
`bench.api_diff` and the tool-calling tests.

CLI: `python -m devtools.tool_checkpoint --out DIR`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from devtools.checkpoint_builder import ASSETS_DIR, build_checkpoint, is_complete_checkpoint

TOOL_TEMPLATE_PATH = ASSETS_DIR / "tool_chat_template.jinja"
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")


def build_tool_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """The checkpoint folder (built once: an existing complete one is kept)."""
    from transformers import AutoTokenizer

    out = Path(out_dir)
    if is_complete_checkpoint(out) and (out / ".tool-tokens").is_file():
        return out
    build_checkpoint(
        out,
        "qwen2",
        seed=seed,
        hidden_size=256,
        intermediate_size=512,
        max_position_embeddings=2048,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_tokens(list(TOOL_TOKENS), special_tokens=False)
    tokenizer.chat_template = TOOL_TEMPLATE_PATH.read_text()
    vocab_size = _config_vocab_size(out)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"{len(tokenizer)} tokens do not fit the model's {vocab_size}")
    tokenizer.save_pretrained(str(out))
    (out / ".tool-tokens").write_text(" ".join(TOOL_TOKENS) + "\n")
    return out


def _config_vocab_size(folder: Path) -> int:
    import json

    return int(json.loads((folder / "config.json").read_text())["vocab_size"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    print(build_tool_checkpoint(args.out))


if __name__ == "__main__":
    main()
