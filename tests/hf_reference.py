"""Hugging Face `transformers` as the correctness reference: greedy generate in fp32 on CPU."""

from __future__ import annotations

import functools
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@functools.lru_cache(maxsize=4)
def hf_model(folder: str):
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@functools.lru_cache(maxsize=4)
def hf_tokenizer(folder: str):
    return AutoTokenizer.from_pretrained(folder)


@torch.inference_mode()
def hf_greedy(folder: str | os.PathLike, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """New token ids of `generate(do_sample=False)` (stops at the checkpoint's EOS)."""
    model = hf_model(str(folder))
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=model.generation_config.eos_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()
