"""GGUF files as models (common/gguf_checkpoint.py): a float32 GGUF of the tiny llama comes
back as the very same checkpoint (weights, config, tokenizer, chat template); a quantized
one holds exactly what the `gguf` package dequantizes; the folder is built once per file;
and every kind of bad file is refused with one line naming the problem."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from common.gguf_checkpoint import COMPLETE, inspect_gguf, materialize, resolve_model
from common.hf_checkpoint_reader import iter_tensors, load_tokenizer
from common.model_config import ModelConfig
from tests.tiny_gguf import gguf_checkpoint, write_gguf

TEXTS = ["Hello there, world!", "naïve café 中文字符 🚀", "KV blocks move between workers"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return gguf_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def ggufs(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {q: write_gguf(tiny, folder / f"tiny-{q}.gguf", q) for q in ("F32", "Q8_0")}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_GGUF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_the_other_served_architectures_convert_exactly(architecture, tmp_path):
    """Qwen2's q/k/v biases and Qwen3's q/k norms come back from llama.cpp's names."""
    folder = gguf_checkpoint(tmp_path / architecture, architecture)
    out = materialize(write_gguf(folder, tmp_path / f"{architecture}.gguf", "F32"))
    weights = load_file(out / "model.safetensors")
    original = dict(iter_tensors(folder, lambda _: True))
    assert weights.keys() == original.keys()
    assert all(torch.equal(weights[n], t.float()) for n, t in original.items())
    assert ModelConfig.from_folder(out).architecture == architecture


def test_a_float32_gguf_is_the_same_checkpoint(tiny, ggufs, cache):
    out = materialize(ggufs["F32"])
    assert out.parent.parent == cache and out.name == "tiny-F32"  # clients see the stem
    weights = load_file(out / "model.safetensors")
    original = dict(iter_tensors(tiny, lambda _: True))
    assert weights.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(weights[name], tensor.float()), name
    got, want = ModelConfig.from_folder(out), ModelConfig.from_folder(tiny)
    fields = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
              "head_dim", "vocab_size", "rope_theta", "eos_token_ids")  # fmt: skip
    for field in fields:
        assert getattr(got, field) == getattr(want, field), field
    tok, ref = load_tokenizer(out), load_tokenizer(tiny)
    assert [tok.encode(t) for t in TEXTS] == [ref.encode(t) for t in TEXTS]
    assert tok.chat_template == ref.chat_template
    # Built once: a second call (any service's start) finds it whole.
    stamp = (out / COMPLETE).stat().st_mtime_ns
    assert resolve_model(str(ggufs["F32"])) == str(out)
    assert (out / COMPLETE).stat().st_mtime_ns == stamp


def test_quantized_weights_are_what_the_gguf_package_dequantizes(tiny, ggufs):
    import gguf

    assert inspect_gguf(ggufs["Q8_0"]).quant_types == ("F32", "Q8_0")
    weights = load_file(materialize(ggufs["Q8_0"]) / "model.safetensors")
    original = dict(iter_tensors(tiny, lambda _: True))
    name = "model.layers.1.self_attn.v_proj.weight"  # (v: no llama.cpp row reordering)
    q8 = gguf.GGMLQuantizationType.Q8_0
    expect = gguf.quants.dequantize(gguf.quants.quantize(original[name].numpy(), q8), q8)
    assert np.array_equal(weights[name].numpy(), expect)
    assert not torch.equal(weights[name], original[name])  # really quantized
    assert torch.allclose(weights[name], original[name], atol=0.01)
    norm = "model.layers.1.input_layernorm.weight"  # norms stay float32
    assert torch.equal(weights[norm], original[norm])


def _retype(path, tensor_type: int) -> None:
    """Patch the first 2-D tensor's type id in place."""
    from gguf import GGUFReader

    reader = GGUFReader(path, "r+")
    tensor = next(t for t in reader.tensors if len(t.shape) == 2)
    tensor.field.parts[4][0] = tensor_type
    reader.data.flush()


def test_bad_files_are_refused_in_one_line(tiny, ggufs, tmp_path):
    good = ggufs["F32"].read_bytes()
    cases = {}
    cases["missing"] = (tmp_path / "absent.gguf", "no such GGUF file")
    (tmp_path / "text.gguf").write_text("not a model at all")
    cases["not gguf"] = (tmp_path / "text.gguf", "not a GGUF file")
    (tmp_path / "cut.gguf").write_bytes(good[: len(good) // 2])
    cases["truncated"] = (tmp_path / "cut.gguf", "truncated")
    (tmp_path / "header.gguf").write_bytes(good[:40])
    cases["cut in its header"] = (tmp_path / "header.gguf", "not a valid GGUF file")
    (tmp_path / "unknown.gguf").write_bytes(good)
    _retype(tmp_path / "unknown.gguf", 97)
    cases["unknown quant type"] = (tmp_path / "unknown.gguf", "unknown quant type")
    (tmp_path / "q8_1.gguf").write_bytes(good)
    _retype(tmp_path / "q8_1.gguf", 9)  # Q8_1: a llama.cpp type the gguf package cannot read
    cases["undequantizable"] = (tmp_path / "q8_1.gguf", "Q8_1")
    gpt2 = write_gguf(tiny, tmp_path / "gpt2.gguf", "F32", architecture="gpt2")
    cases["architecture"] = (gpt2, "architecture 'gpt2' is not served")
    for what, (path, message) in cases.items():
        with pytest.raises(ValueError) as refused:
            materialize(path)
        text = str(refused.value)
        assert message in text and "\n" not in text, (what, text)
        assert str(path.name) in text, (what, text)


def test_a_tokenizer_folder_goes_only_with_a_gguf(tiny, ggufs):
    with pytest.raises(ValueError, match="--tokenizer goes with a .gguf"):
        resolve_model(str(tiny), str(tiny))
    out = resolve_model(str(ggufs["Q8_0"]), str(tiny))  # its tokenizer, not the file's
    assert load_tokenizer(out).encode(TEXTS[0]) == load_tokenizer(tiny).encode(TEXTS[0])
    assert out != str(materialize(ggufs["Q8_0"]))  # a cache entry of its own
