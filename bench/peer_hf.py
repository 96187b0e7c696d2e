"""HF `generate` on the performance benchmark's prompts (the same texts vLLM's client sends,
tokenized the way both servers tokenize them): static left-padded batches for throughput,
and one prompt at a time for the single-stream per-token time. float32, greedy, every
output token generated (EOS ignored, as `--ignore-eos` does for the servers)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch


def _generate(model, tokenizer, prompts: Sequence[str], max_new: int) -> int:
    batch = tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=True)
    out = model.generate(
        **batch,
        do_sample=False,
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        pad_token_id=tokenizer.pad_token_id,
    )
    return (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)


@torch.inference_mode()
def hf_generate_baseline(
    model_dir: str, prompts: Sequence[str], output_len: int, batch_size: int, single: int
) -> dict:
    """Throughput of static batches of `batch_size` over `prompts`, and per-token time and
    time to first token of `single` prompts run alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _generate(model, tokenizer, prompts[:2], 4)  # warm-up
    started = time.perf_counter()
    generated = sum(
        _generate(model, tokenizer, prompts[i : i + batch_size], output_len)
        for i in range(0, len(prompts), batch_size)
    )
    wall = time.perf_counter() - started
    ttfts, tpots = [], []
    for prompt in prompts[:single]:
        first = time.perf_counter()
        _generate(model, tokenizer, [prompt], 1)
        ttft = time.perf_counter() - first
        whole = time.perf_counter()
        _generate(model, tokenizer, [prompt], output_len)
        total = time.perf_counter() - whole
        ttfts.append(ttft)
        tpots.append((total - ttft) / (output_len - 1))
    return {
        "batch_size": batch_size,
        "num_prompts": len(prompts),
        "output_tokens": generated,
        "wall_s": round(wall, 3),
        "output_throughput": round(generated / wall, 2),
        "single_stream_prompts": single,
        "single_stream_ttft_ms": round(1e3 * statistics.median(ttfts), 2),
        "single_stream_tpot_ms": round(1e3 * statistics.median(tpots), 3),
        "single_stream_output_throughput": round(1 / statistics.median(tpots), 2),
        "torch_threads": torch.get_num_threads(),
    }
