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


def fresh_rope(model) -> None:
    """Undo what earlier calls left in transformers' dynamic RoPE: `dynamic_rope_update`
    keeps the frequencies of the longest call so far (until a call shorter than
    max_position_embeddings), so a model object's output depends on what it ran before.
    Back to the initial frequencies, each call is what a freshly loaded model gives (what
    Tandem reproduces)."""
    rope = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rope is not None and "dynamic" in str(getattr(rope, "rope_type", "")):
        rope.register_buffer("inv_freq", rope.original_inv_freq.clone(), persistent=False)
        rope.max_seq_len_cached = rope.original_max_seq_len


@functools.lru_cache(maxsize=4)
def hf_tokenizer(folder: str):
    return AutoTokenizer.from_pretrained(folder)


def hf_greedy(folder: str | os.PathLike, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """New token ids of `generate(do_sample=False)` (stops at the checkpoint's EOS).

    Remembered per (checkpoint folder, prompt, length) for the session, as `hf_model` is:
    many modules check the same workloads against HF, and a checkpoint folder is never
    rewritten in place."""
    return list(_hf_greedy(str(folder), tuple(prompt_ids), max_new_tokens))


@functools.lru_cache(maxsize=4096)
@torch.inference_mode()
def _hf_greedy(folder: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = hf_model(folder)
    fresh_rope(model)
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=model.generation_config.eos_token_id,
    )
    return tuple(out[0, len(prompt_ids) :].tolist())


@torch.inference_mode()
def hf_generate(folder: str | os.PathLike, prompt_ids: list[int], **kwargs) -> list[int]:
    """New token ids of greedy `generate` with extra generation settings (e.g.
    repetition_penalty, min_new_tokens, sequence_bias, eos_token_id)."""
    model = hf_model(str(folder))
    fresh_rope(model)
    input_ids = torch.tensor([prompt_ids])
    kwargs.setdefault("pad_token_id", model.generation_config.eos_token_id)
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, **kwargs
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def hf_log_softmax(folder: str | os.PathLike, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of one sequence, [len, vocab]."""
    model = hf_model(str(folder))
    fresh_rope(model)
    logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def hf_beam_search(
    folder: str | os.PathLike,
    prompt_ids: list[int],
    *,
    num_beams: int,
    max_new_tokens: int,
    eos_token_ids: list[int],
    num_return_sequences: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> list[tuple[list[int], float]]:
    """`generate(num_beams=k, do_sample=False)`'s returned hypotheses, best first: (new token
    ids without HF's trailing padding, sequences_scores). Remembered like `hf_greedy`."""
    hyps = _hf_beam_search(
        str(folder), tuple(prompt_ids), num_beams, max_new_tokens, tuple(eos_token_ids),
        num_return_sequences, length_penalty, early_stopping,
    )  # fmt: skip
    return [(list(tokens), score) for tokens, score in hyps]


@functools.lru_cache(maxsize=1024)
@torch.inference_mode()
def _hf_beam_search(
    folder: str,
    prompt_ids: tuple[int, ...],
    num_beams: int,
    max_new_tokens: int,
    eos_token_ids: tuple[int, ...],
    num_return_sequences: int,
    length_penalty: float,
    early_stopping: bool | str,
) -> tuple[tuple[tuple[int, ...], float], ...]:
    model = hf_model(folder)
    fresh_rope(model)
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        num_beams=num_beams,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        num_return_sequences=num_return_sequences,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=list(eos_token_ids),
        pad_token_id=eos_token_ids[0],
        return_dict_in_generate=True,
        output_scores=True,
    )
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()  # generated tokens, EOS included
    seqs = out.sequences[:, len(prompt_ids) :]
    return tuple(
        (tuple(row[:n].tolist()), score)
        for row, n, score in zip(seqs, lengths, out.sequences_scores.tolist(), strict=True)
    )
