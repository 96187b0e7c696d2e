"""Incremental detokenization with the real BPE tokenizer: deltas never split a character,
and their concatenation equals a one-shot decode."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.hf_checkpoint_reader import load_tokenizer
from services.gateway.detokenizer import REPLACEMENT, IncrementalDetokenizer

MULTIBYTE_TEXT = "naïve café — Ελληνικά, русский, 中文字符 and emoji 🚀🎉 done."


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def stream(tokenizer, ids, prompt=(), chunk=1):
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


def test_multibyte_characters_split_across_tokens_are_held_until_complete(tokenizer):
    ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    # The corpus-trained BPE must really split some characters across tokens for this
    # test to mean anything.
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any(REPLACEMENT in p for p in pieces)
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == MULTIBYTE_TEXT
    assert not any(REPLACEMENT in d for d in deltas)
    assert "" in deltas  # some steps emitted nothing: they ended inside a character


def test_prompt_context_does_not_leak_into_output(tokenizer):
    prompt = tokenizer.encode("Once upon a time", add_special_tokens=False)
    ids = tokenizer.encode(" there was a 🚀 rocket", add_special_tokens=False)
    assert "".join(stream(tokenizer, ids, prompt)) == tokenizer.decode(ids)


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("hello world", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(stream(tokenizer, ids)) == "hello world"


def test_flush_emits_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    partial = [i for i in ids]
    detok = IncrementalDetokenizer(tokenizer)
    # Feed every byte-token of the emoji but the last: nothing may come out.
    out = [detok.add([i]) for i in partial[:-1]]
    if len(partial) > 1:
        assert out == [""] * (len(partial) - 1)
    assert detok.flush() == tokenizer.decode(partial[:-1])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), chunk=st.integers(1, 4))
def test_random_token_streams_round_trip(tokenizer, seed, chunk):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
    prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 8))]
    deltas = stream(tokenizer, ids, prompt, chunk)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    # Only the final flush may carry a replacement character that decode also shows.
    assert not any(d.endswith(REPLACEMENT) for d in deltas[:-1])
