"""Random-weight checkpoint builder: tokenizer, config, shards, default model, CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.model_config import ModelConfig
from devtools.checkpoint_builder import (
    CORPUS_PATH,
    DEFAULT_MODEL_NAME,
    build_checkpoint,
    build_default_model,
    build_tokenizer,
    is_complete_checkpoint,
    main,
)

MULTI_BYTE_TEXTS = [
    "Café crème and déjà vu in Noël",
    "Ωραία μέρα για περίπατο",
    "Сегодня хорошая погода",
    "今天天气很好，我们去公园散步吧。",
    "Emoji 🙂🚀 👩‍💻 🇫🇷 mixed",
    "unseen: ǅ ꙮ 𝄞 \u200b tabs\tand\nnewlines  double  spaces ",
]


def test_corpus_is_sizeable_and_multilingual() -> None:
    text = CORPUS_PATH.read_text(encoding="utf-8")
    assert 30_000 <= len(text.encode("utf-8")) <= 80_000
    for sample in ("é", "Ω", "д", "天", "🙂", "날"):
        assert sample in text


def test_tokenizer_loads_and_round_trips(tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert len(tokenizer) == 1024
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    assert tokenizer.pad_token == "<pad>"
    for text in MULTI_BYTE_TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # merges were learned inside multi-byte characters: a 2-byte and a 3-byte char are one token
    assert len(tokenizer("ç")["input_ids"]) == 1
    assert len(tokenizer("。")["input_ids"]) == 1
    whole_chars = [
        text
        for text in (tokenizer.decode([i]) for i in range(len(tokenizer)))
        if "\ufffd" not in text and any(ord(ch) > 127 for ch in text)
    ]
    assert len(whole_chars) >= 10


def test_tokenizer_training_is_deterministic(tmp_path: Path) -> None:
    build_tokenizer(tmp_path / "a", vocab_size=600)
    build_tokenizer(tmp_path / "b", vocab_size=600)
    a = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert a == (tmp_path / "b" / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path / "c", vocab_size=100)


def test_chat_template(tiny_qwen2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ☕"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s>system: Be brief.</s>\nuser: Hi ☕</s>\nassistant: "
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    assert plain == "<s>system: Be brief.</s>\nuser: Hi ☕</s>\n"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.eos_token_id) == 2  # specials inside the template stay atomic


def test_config_and_generation_config(tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    config = ModelConfig.from_folder(tiny_llama_dir)
    assert config.architecture == "llama"
    assert config.vocab_size % 64 == 0 and config.vocab_size >= len(tokenizer)
    assert config.eos_token_ids == (tokenizer.eos_token_id,)
    assert config.bos_token_id == tokenizer.bos_token_id
    generation = json.loads((tiny_llama_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids("</s>")
    assert generation["bos_token_id"] == tokenizer.convert_tokens_to_ids("<s>")


def test_sharded_index(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> None:
    index = json.loads((tiny_llama_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert all((tiny_llama_dir / shard).is_file() for shard in shards)
    assert "model.layers.1.self_attn.q_proj.weight" in index["weight_map"]
    assert not (tiny_llama_dir / "model.safetensors").exists()
    assert (tiny_qwen2_dir / "model.safetensors").is_file()
    assert is_complete_checkpoint(tiny_llama_dir) and is_complete_checkpoint(tiny_qwen2_dir)


def test_weights_are_seeded_and_not_default_init(tmp_path: Path) -> None:
    a = build_checkpoint(tmp_path / "a", "qwen2", seed=5)
    b = build_checkpoint(tmp_path / "b", "qwen2", seed=5)
    c = build_checkpoint(tmp_path / "c", "qwen2", seed=6)
    weights = "model.safetensors"
    assert (a / weights).read_bytes() == (b / weights).read_bytes()
    assert (a / weights).read_bytes() != (c / weights).read_bytes()
    from safetensors.torch import load_file

    tensors = load_file(a / weights)
    assert not torch.equal(
        tensors["model.norm.weight"], torch.ones_like(tensors["model.norm.weight"])
    )
    assert tensors["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0


def test_tied_and_scaled_variants(tmp_path: Path) -> None:
    folder = build_checkpoint(
        tmp_path / "tied",
        "llama",
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        vocab_size=1088,
    )
    config = ModelConfig.from_folder(folder)
    assert config.tie_word_embeddings and config.vocab_size == 1088
    assert config.rope_scaling == (("factor", 2.0), ("rope_type", "linear"))
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_checkpoint(tmp_path / "small", "llama", vocab_size=512)
    with pytest.raises(ValueError, match="unsupported architecture"):
        build_checkpoint(tmp_path / "bad", "gpt2")


def test_default_model_is_built_once_and_generates(tmp_path: Path) -> None:
    out = tmp_path / DEFAULT_MODEL_NAME
    assert build_default_model(out) == out
    config = ModelConfig.from_folder(out)
    assert config.name == DEFAULT_MODEL_NAME
    assert (config.hidden_size, config.num_hidden_layers) == (256, 4)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 2)
    assert (config.intermediate_size, config.max_position_embeddings) == (688, 2048)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) >= 4000
    assert len(tokenizer("天")["input_ids"]) == len(tokenizer("ü")["input_ids"]) == 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert not [p for p in tmp_path.iterdir() if p.name != DEFAULT_MODEL_NAME], "staging left"
    assert out.stat().st_mode & 0o755 == 0o755
    assert all(p.stat().st_mode & 0o644 == 0o644 for p in out.iterdir()), "shareable files"

    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert build_default_model(out) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompt = tokenizer("The scheduler decides which work runs next", return_tensors="pt")
    generated = model.generate(**prompt, do_sample=False, max_new_tokens=32)
    new_tokens = generated[0, prompt["input_ids"].shape[1] :].tolist()
    assert len(set(new_tokens)) >= 8, f"degenerate greedy output {new_tokens}"


def test_default_model_refuses_to_overwrite_foreign_folder(tmp_path: Path) -> None:
    out = tmp_path / "occupied"
    out.mkdir()
    (out / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        build_default_model(out)


def test_cli_builds_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli-qwen3"
    main(["--out", os.fspath(out), "--tiny", "--arch", "qwen3"])
    assert capsys.readouterr().out.strip() == os.fspath(out)
    assert ModelConfig.from_folder(out).architecture == "qwen3"
