"""Writing a test checkpoint as a GGUF file with the `gguf` package, the way llama.cpp's
converter lays one out: llama.cpp's tensor names, its Q/K row order for llama (heads
permuted for its rotary layout), 2-D weights quantized to the requested type by the
`gguf` package itself (norms stay float32), and the tokenizer as GGUF metadata (a
byte-level BPE: `gpt2` model, tokens, merges, special ids, chat template). Reading it back
is transformers' job (`AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`), which is
the reference the tests compare Tandem with."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from common.hf_checkpoint_reader import iter_tensors

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of an HF tensor (`model.layers.<i>.<rest>` -> `blk.<i>.<...>`)."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for a llama Q or K projection (its rotary pairs)."""
    rows = weights.shape[0]
    return (
        weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(
    folder: str | os.PathLike,
    out: str | os.PathLike,
    qtype: str = "F32",
    architecture: str | None = None,
    name: str = "tandem-tiny",
) -> Path:
    """`folder` (an HF checkpoint of a llama / qwen2 / qwen3 whose vocabulary has a row more
    than its tokenizer, see `gguf_checkpoint`) as a GGUF file at `out`, its 2-D weights in
    `qtype` (F32, F16, Q8_0, Q4_0, ...). `architecture` overrides the file's
    `general.architecture` (to write one Tandem does not serve)."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    arch = architecture or _GGUF_ARCH[config.model_type]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 1e4))))
    writer.add_vocab_size(config.vocab_size)
    _add_tokenizer(writer, tokenizer, folder, config.vocab_size)
    quant = gguf.GGMLQuantizationType[qtype]
    for hf_name, tensor in iter_tensors(folder, lambda _: True):
        array = tensor.float().numpy()
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")) and arch == "llama":
            q = "q_proj" in hf_name
            array = _permute(array, config.num_attention_heads if q else config.num_key_value_heads)
        target = gguf_name(hf_name)
        if array.ndim == 2 and quant not in (gguf.GGMLQuantizationType.F32,):
            if quant == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(target, array.astype(np.float16))
            else:
                writer.add_tensor(target, gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(target, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def _add_tokenizer(writer, tokenizer, folder, vocab_size: int) -> None:
    """The byte-level BPE as GGUF metadata, padded to the embedding's rows."""
    import gguf

    spec = json.loads((Path(folder) / "tokenizer.json").read_text())
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    tokens = [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))]
    special = set(tokenizer.all_special_ids)
    types = [
        gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    for i in range(len(tokens), vocab_size):  # the first: what a byte-level GGUF tokenizer
        # always has (transformers adds it, past the vocabulary, when it is missing)
        tokens.append("<|endoftext|>" if "<|endoftext|>" not in tokens else f"<unused{i}>")
        types.append(gguf.TokenType.CONTROL if tokens[-1][1] == "|" else gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    if tokenizer.eos_token_id is not None:
        writer.add_eos_token_id(tokenizer.eos_token_id)
    if tokenizer.pad_token_id is not None:
        writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def gguf_checkpoint(out, architecture: str = "llama"):
    """A tiny random checkpoint for GGUF tests: the tiny llama's shape with a padded
    vocabulary (1088 rows for 1024 tokens, as real GGUF vocabularies carry spare ids)."""
    from devtools.checkpoint_builder import build_checkpoint

    return build_checkpoint(out, architecture, vocab_size=1088)
