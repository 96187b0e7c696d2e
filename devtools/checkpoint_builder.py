"""Builds small random-weight Hugging Face checkpoints (tokenizer included) from scratch.

Tandem never downloads models: tests and the embedded default model served by `make up` are
built here. The tokenizer is a byte-level BPE trained on `devtools/assets/corpus.txt`; the
weights come from transformers' own model classes after `torch.manual_seed(seed)`, with a
wider init than usual (and non-trivial norm weights and biases) so that logits are far from
uniform and greedy decoding does not collapse onto one token. The result is an ordinary HF
folder that both transformers and Tandem's loader read. Mixture-of-experts architectures
(mixtral, qwen3_moe, deepseek_v2, deepseek_v3) get `TINY_MOE` experts unless `moe=`
overrides its fields; the tiny qwen3_moe and DeepSeeks keep layer 0 dense
(`mlp_only_layers`, `first_k_dense_replace`), so both kinds of layer run. DeepSeek's latent
attention takes `TINY_MLA`'s sizes (`config_overrides` changes them), and V3's router
correction bias is random. Gemma 2 /
Gemma 3 text keep their config classes' defaults (soft-caps, `query_pre_attn_scalar`,
alternating sliding layers), Gemma 3 with its own RoPE thetas per layer type (a
`rope_scaling` applies to its full layers); their norm weights (applied as 1 + w) are
perturbed around 0. gpt-oss gets `TINY_MOE` experts too; its experts' biases are perturbed
like the others and its attention sinks drawn from N(0, 1), so that they matter
(`devtools.mxfp4_checkpoint` then stores its experts in MXFP4, as the real checkpoints do).

CLI: `python -m devtools.checkpoint_builder --out DIR [--arch llama] [--tiny]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
CORPUS_PATH = ASSETS_DIR / "corpus.txt"
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
DEFAULT_MODEL_NAME = "tandem-tiny-llama"
SUPPORTED_ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma2", "gemma3_text",
    "gpt_oss",
    "deepseek_v2", "deepseek_v3",
)  # fmt: skip
GEMMA = ("gemma2", "gemma3_text")
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
# The latent attention of a tiny DeepSeek checkpoint (entries of 32 + 16 values).
TINY_MLA: dict[str, Any] = {
    "kv_lora_rank": 32,
    "q_lora_rank": 24,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 24,
}
# The experts of a tiny MoE checkpoint (each architecture keeps the fields it has).
TINY_MOE: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 96,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    },
    # layer 0 dense; 8 experts in 4 groups, the best 2 groups (V3 sigmoid + correction bias)
    "deepseek_v3": {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
    },
    "deepseek_v2": {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "n_shared_experts": 2,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "group_limited_greedy",
        "routed_scaling_factor": 1.5,
        "first_k_dense_replace": 1,
    },
}
INITIALIZER_RANGE = 0.2

# One line per message, then an optional open assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

DEFAULT_MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tokenizer_vocab_size": 4096,
    "seed": 0,
    "max_shard_size": "8MB",
    "dtype": torch.float32,
}


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 1024) -> None:
    """Train a byte-level BPE on the bundled corpus and save it as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]
    if vocab_size < 256 + len(special):
        raise ValueError(f"tokenizer vocab_size must be >= {256 + len(special)}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS_PATH)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
    )
    fast.save_pretrained(str(out_dir))


def build_checkpoint(
    out_dir: str | os.PathLike,
    architecture: str = "llama",
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vocab_size: int | None = None,
    max_position_embeddings: int = 512,
    tokenizer_vocab_size: int = 1024,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    moe: dict[str, Any] | None = None,
    save_original_format: bool = True,
    sliding_window: int | None = None,
    max_window_layers: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a complete random-weight HF checkpoint folder and return its path. `moe`:
    fields over `TINY_MOE[architecture]` (MoE architectures only); `save_original_format`
    False writes transformers v5's fused expert tensors instead of one per expert.
    `sliding_window`: every layer windowed (mistral, mixtral, qwen3_moe), or, for qwen2 and
    qwen3, `use_sliding_window` with layers from `max_window_layers` on windowed; for the
    Gemmas, the window of their sliding layers. `config_overrides`: any other config fields
    (e.g. Gemma's `layer_types`, soft-caps)."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if moe and architecture not in TINY_MOE:
        raise ValueError(f"moe= applies to {', '.join(TINY_MOE)} only, not {architecture!r}")
    from transformers import AutoTokenizer, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, tokenizer_vocab_size)
    # Counted as the architecture loads it (a Qwen2 tokenizer adds <|endoftext|>): a config
    # naming the architecture first, so AutoTokenizer picks that tokenizer class.
    _hf_config(
        architecture,
        num_hidden_layers=num_hidden_layers,
        vocab_size=tokenizer_vocab_size,
    ).save_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    token_count = len(tokenizer)
    if vocab_size is None:
        vocab_size = -(-token_count // 64) * 64
    if vocab_size < token_count:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({token_count})")
    bos_id = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)

    if architecture in DEEPSEEK:  # (MLA: transformers expands the latent into every head)
        num_key_value_heads = num_attention_heads
    config = _hf_config(
        architecture,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=_rope_parameters(architecture, rope_scaling),
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=INITIALIZER_RANGE,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **{**TINY_MOE.get(architecture, {}), **(moe or {})},
        **_window_fields(architecture, sliding_window, max_window_layers),
        **{**(TINY_MLA if architecture in DEEPSEEK else {}), **(config_overrides or {})},
    )
    model = _random_model(config, seed).to(dtype)
    save_kwargs: dict[str, Any] = {"save_original_format": save_original_format}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **save_kwargs)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(
        str(out)
    )
    for file in out.iterdir():  # safetensors shards are written 0600; make the folder shareable
        file.chmod(0o644)
    return out


def _hf_config(architecture: str, **kwargs: Any) -> Any:
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "gemma2": transformers.Gemma2Config,
        "gemma3_text": transformers.Gemma3TextConfig,
        "gpt_oss": transformers.GptOssConfig,
        "deepseek_v2": transformers.DeepseekV2Config,
        "deepseek_v3": transformers.DeepseekV3Config,
    }
    extra: dict[str, Any] = {}
    if architecture in ("mistral", "mixtral"):
        extra["sliding_window"] = None
    if architecture == "qwen3_moe":
        extra["use_sliding_window"] = False
    if architecture in ("qwen2", "qwen3"):
        extra["use_sliding_window"] = False
        extra["max_window_layers"] = kwargs["num_hidden_layers"]
    return classes[architecture](**{**extra, **kwargs})


def _window_fields(architecture: str, window: int | None, max_window_layers: int) -> dict:
    """The config fields of a sliding window (none: `_hf_config`'s full-attention defaults)."""
    if window is None:
        return {}
    if architecture in ("mistral", "mixtral"):
        return {"sliding_window": window}
    if architecture == "qwen3_moe":
        return {"use_sliding_window": True, "sliding_window": window}
    if architecture in (*GEMMA, "gpt_oss"):
        return {"sliding_window": window}
    if architecture in ("qwen2", "qwen3"):
        return {
            "use_sliding_window": True,
            "sliding_window": window,
            "max_window_layers": max_window_layers,
        }
    raise ValueError(f"{architecture} has no sliding window")


def _rope_parameters(architecture: str, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Gemma 3's per layer type (its config class's thetas, `scaling` on the full layers);
    every other architecture's one dict."""
    if architecture == "gemma3_text":
        return {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6, **(scaling or {})},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    return {"rope_type": "default", "rope_theta": 10000.0, **(scaling or {})}


def _random_model(config: Any, seed: int) -> torch.nn.Module:
    """HF model with seeded random weights; norms and biases perturbed away from 1 and 0
    (Gemma's norms, which scale by 1 + weight, away from 0)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    norm_base = 0.0 if config.model_type in GEMMA else 1.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(norm_base + 0.1 * torch.randn_like(param))
            elif name.endswith((".bias", "_proj_bias")):  # (gpt-oss's experts: *_proj_bias)
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith("self_attn.sinks"):  # gpt-oss
                param.copy_(torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's, zero at init
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model


def is_complete_checkpoint(folder: str | os.PathLike) -> bool:
    """True when `folder` holds config, generation config, tokenizer and every weight file."""
    path = Path(folder)
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        if not (path / name).is_file():
            return False
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            with open(index, encoding="utf-8") as handle:
                shards = set(json.load(handle)["weight_map"].values())
        except (ValueError, KeyError, TypeError):
            return False
        return bool(shards) and all((path / shard).is_file() for shard in shards)
    return (path / "model.safetensors").is_file()


def build_default_model(out_dir: str | os.PathLike, architecture: str = "llama") -> Path:
    """Build the embedded default model into `out_dir`, unless a complete one is already there.

    Builds into a temporary sibling folder and renames it into place, so an interrupted build
    never leaves a half-written checkpoint behind.
    """
    out = Path(out_dir)
    if is_complete_checkpoint(out):
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"{str(out)!r} exists but is not a complete checkpoint; remove it to rebuild"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        build_checkpoint(staging, architecture, **DEFAULT_MODEL_SHAPE)
        staging.chmod(0o755)  # mkdtemp creates 0700
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.checkpoint_builder",
        description="Build a random-weight checkpoint (default: the embedded default model).",
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--arch", default="llama", choices=SUPPORTED_ARCHITECTURES)
    parser.add_argument("--tiny", action="store_true", help="build a tiny test-sized model")
    args = parser.parse_args(argv)
    if args.tiny:
        path = build_checkpoint(args.out, args.arch)
    else:
        path = build_default_model(args.out, args.arch)
    print(path)


if __name__ == "__main__":
    main()
