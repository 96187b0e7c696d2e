"""Perplexity of the held-out text (`bench/quality_heldout.txt`), token-weighted over
sliding windows, through a running stack (`prompt_logprobs` on Generate: each prompt
position's log-probability of the actual next token) and, as the reference, through HF
transformers in fp32 on the same windows.

Windows: the text's tokens (no BOS: SmolLM2's tokenizer adds none) cut into windows of
`WINDOW` tokens every `STRIDE` tokens (the last one ends at the text's end); each token is
scored once, in the first window where it has at least `WINDOW - STRIDE` tokens of context
(the first window scores all its tokens after the first) — HF's sliding-window recipe.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc

HELDOUT = Path(__file__).resolve().parent / "quality_heldout.txt"
WINDOW, STRIDE = 512, 256


def heldout_text(path: Path = HELDOUT) -> str:
    """The held-out text without its '#' header lines."""
    lines = path.read_text().splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith("#")).strip() + "\n"


def paragraphs(path: Path = HELDOUT) -> list[str]:
    return [p.strip() for p in heldout_text(path).split("\n\n") if p.strip()]


@dataclass(frozen=True)
class Window:
    tokens: tuple[int, ...]
    first_scored: int  # index (in tokens) of the first token scored in this window


def windows(ids: list[int], size: int = WINDOW, stride: int = STRIDE) -> list[Window]:
    out, scored_to, begin = [], 1, 0
    while True:
        end = min(begin + size, len(ids))
        out.append(Window(tuple(ids[begin:end]), scored_to - begin))
        scored_to = end
        if end == len(ids):
            return out
        begin = min(begin + stride, len(ids) - size)


def scored(per_window: list[list[float]], wins: list[Window]) -> list[float]:
    """The scored tokens' log-probs, in text order (entry j of a window's list is token
    j + 1's log-prob given tokens 0..j)."""
    out: list[float] = []
    for lps, w in zip(per_window, wins, strict=True):
        assert len(lps) == len(w.tokens) - 1, (len(lps), len(w.tokens))
        out.extend(lps[w.first_scored - 1 :])
    return out


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def hf_logprobs(folder: Path, wins: list[Window], dtype=None) -> list[list[float]]:
    """Each window's next-token log-probs under HF transformers (fp32 by default)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32).eval()
    out = []
    with torch.inference_mode():
        for w in wins:
            ids = torch.tensor([w.tokens])
            logits = model(ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            out.append(lp.tolist())
    return out


def _tandem_window(stub, w: Window) -> list[float]:
    request = generate_pb2.GenerateRequest(max_tokens=1, prompt_logprobs=0)
    request.token_ids.ids.extend(w.tokens)
    request.sampling.temperature = 0.0
    out: list[float] = []
    for message in stub.Generate(request, timeout=600):
        if message.prompt_logprobs:
            assert [e.token_id for e in message.prompt_logprobs] == list(w.tokens[1:])
            out = [e.logprob for e in message.prompt_logprobs]
    return out


def tandem_logprobs(address: str, wins: list[Window], concurrency: int = 2) -> list[list[float]]:
    """Each window's prompt log-probs from the stack's gateway (`concurrency` in flight)."""
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda w: _tandem_window(stub, w), wins))


def compare(ours: list[float], reference: list[float]) -> dict:
    """Per-token and perplexity agreement of two scored log-prob lists."""
    diffs = [abs(a - b) for a, b in zip(ours, reference, strict=True)]
    p, q = perplexity(ours), perplexity(reference)
    return {
        "max_abs_logprob_diff": round(max(diffs), 6),
        "mean_abs_logprob_diff": round(sum(diffs) / len(diffs), 7),
        "ppl_rel_diff": round(p / q - 1, 7),
    }
