"""Loads the model's tokenizer (Hugging Face `tokenizer.json` / `tokenizer_config.json`)."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(folder: str | os.PathLike) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(os.fspath(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {folder}: {exc}") from exc
