"""The benchmark models: random-weight Llama checkpoints of realistic small sizes, built on
first use under `.tandem/models/<name>` (nothing is downloaded), and the real default model.

`llama-32m` is the model of the performance issue (hidden 512, 8 layers, 8 heads / 4 KV
heads, vocabulary 8192); `llama-150m` the larger one the same ratios must hold on (hidden
1024, 12 layers). Both are float32, untied, with a BPE tokenizer trained on the bundled corpus.
`qwen3-moe-tiny` is a Qwen3-MoE sized like llama-32m (hidden 512, 8 layers, every layer a
sparse block of 8 experts, top 2, expert inner size 512, vocabulary 8192): the MoE model of
issue 43.
`smollm2-135m` is SmolLM2-135M-Instruct, the model `make up` serves (30 narrow layers:
hidden 576, 9 heads / 3 KV heads, vocabulary 49,152, tied embeddings; `devtools.default_model`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / ".tandem" / "models"

BENCH_MODELS: dict[str, dict[str, Any]] = {
    "llama-32m": {
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 8192,
        "tokenizer_vocab_size": 8192,
        "max_position_embeddings": 2048,
    },
    "llama-150m": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "vocab_size": 8192,
        "tokenizer_vocab_size": 8192,
        "max_position_embeddings": 2048,
    },
}
# llama-150m with a 4k context: the KV-streaming benchmark's 2,048-token prompts.
BENCH_MODELS["llama-150m-4k"] = {**BENCH_MODELS["llama-150m"], "max_position_embeddings": 4096}
# The MoE model of issue 43: llama-32m's attention and vocabulary, 8 experts of inner 512 per
# layer (every layer sparse), top 2, renormalised.
BENCH_MODELS["qwen3-moe-tiny"] = {
    **BENCH_MODELS["llama-32m"],
    "architecture": "qwen3_moe",
    "moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}
# The real default model (built from its GGUF, not random).
BENCH_MODELS["smollm2-135m"] = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "real": True,
}


def num_parameters(name: str) -> int:
    """Parameter count of a bench model (untied embeddings and LM head)."""
    s = BENCH_MODELS[name]
    h, inner, layers, vocab = (
        s["hidden_size"],
        s["intermediate_size"],
        s["num_hidden_layers"],
        s["vocab_size"],
    )
    head_dim = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * head_dim
    moe = s.get("moe")
    if moe:  # router plus every expert's gate, up and down
        ffn = h * moe["num_experts"] * (1 + 3 * moe["moe_intermediate_size"])
    else:
        ffn = 3 * h * inner
    per_layer = 2 * h * h + 2 * h * kv + ffn + 2 * h
    embeddings = (1 if s.get("tie_word_embeddings") else 2) * vocab * h
    return embeddings + layers * per_layer + h


def bench_model(name: str, models_dir: Path = MODELS_DIR) -> Path:
    """The folder of bench model `name`, built there first if it is not complete."""
    from devtools.checkpoint_builder import build_checkpoint, is_complete_checkpoint

    if name not in BENCH_MODELS:
        raise ValueError(f"unknown bench model {name!r}; known: {', '.join(BENCH_MODELS)}")
    if BENCH_MODELS[name].get("real"):
        from devtools.default_model import build

        return build()
    out = models_dir / name
    if not is_complete_checkpoint(out):
        shape = dict(BENCH_MODELS[name])
        build_checkpoint(out, shape.pop("architecture", "llama"), **shape, seed=0)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"default: all of {', '.join(BENCH_MODELS)}")
    for name in parser.parse_args(argv).names or list(BENCH_MODELS):
        print(f"{bench_model(name)}  ({num_parameters(name) / 1e6:.1f}M parameters)")


if __name__ == "__main__":
    main()
