"""A tiny Llama briefly trained on the bundled corpus, for accuracy checks that a random
model cannot give: random weights leave next-token logits nearly tied (the top two ~0.4
apart), so any rounding flips greedy choices, while a model that learned something has
margins like a real one. Deterministic (fixed seeds, CPU); ~15 s. The corpus's last tenth
is held out (`held_out_text`) for perplexity."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from devtools.checkpoint_builder import CORPUS_PATH, build_checkpoint

HELD_OUT = 0.1


def corpus_split() -> tuple[str, str]:
    text = CORPUS_PATH.read_text()
    cut = text.rfind("\n\n", 0, int(len(text) * (1 - HELD_OUT)))
    return text[:cut], text[cut:].strip()


def held_out_text() -> str:
    return corpus_split()[1]


def build_trained_checkpoint(
    out_dir: str | os.PathLike, steps: int = 120, batch: int = 8, length: int = 64
) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_checkpoint(out_dir, "llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor(tokenizer(corpus_split()[0])["input_ids"])
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - length, (batch,), generator=generator)
        inputs = torch.stack([ids[s : s + length] for s in starts.tolist()])
        loss = model(input_ids=inputs, labels=inputs).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(folder)
    return folder
