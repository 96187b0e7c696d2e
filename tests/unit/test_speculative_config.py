"""`--speculative-config`: vLLM-shaped JSON in, a checked `SpeculativeConfig` out; n-gram
window resolution, draft-model settings, the JSON round trip, and one clear line per error."""

import pytest

from common.speculative_config import SpeculativeConfig, parse_speculative_config


@pytest.mark.parametrize("text", [None, "", "  ", "null"])
def test_off(text):
    assert parse_speculative_config(text) is None


def test_valid_ngram():
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,'
        ' "prompt_lookup_max": 4, "disable_by_batch_size": 8}'
    )
    assert config == SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=4,
        prompt_lookup_min=2,
        prompt_lookup_max=4,
        disable_by_batch_size=8,
    )
    assert config.model is None and config.num_draft_layers is None


@pytest.mark.parametrize(
    "window, resolved",
    [
        ({}, (5, 5)),  # vLLM's default
        ({"prompt_lookup_max": 3}, (3, 3)),
        ({"prompt_lookup_min": 7}, (7, 7)),
        ({"prompt_lookup_min": 1, "prompt_lookup_max": 32}, (1, 32)),
    ],
)
def test_ngram_window_fills_in_like_vllm(window, resolved):
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, **window)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == resolved


def test_valid_draft_model():
    config = parse_speculative_config(
        '{"method": "draft_model", "model": "/models/tiny", "num_speculative_tokens": 16,'
        ' "num_draft_layers": 2}'
    )
    assert config == SpeculativeConfig(
        method="draft_model", num_speculative_tokens=16, model="/models/tiny", num_draft_layers=2
    )
    assert config.prompt_lookup_min is None and config.prompt_lookup_max is None


def test_method_inferred_from_model_like_vllm():
    ngram = parse_speculative_config('{"model": "ngram", "num_speculative_tokens": 2}')
    assert ngram.method == "ngram" and ngram.model is None
    draft = parse_speculative_config('{"model": "/m", "num_speculative_tokens": 2}')
    assert draft.method == "draft_model" and draft.model == "/m"


@pytest.mark.parametrize(
    "config",
    [
        SpeculativeConfig(method="ngram", num_speculative_tokens=1),
        SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=5,
            prompt_lookup_min=2,
            prompt_lookup_max=9,
            disable_by_batch_size=2,
        ),
        SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model="a b/ü"),
        SpeculativeConfig(
            method="draft_model", num_speculative_tokens=3, model="/m", num_draft_layers=1
        ),
    ],
)
def test_json_round_trip(config):
    text = config.to_json()
    assert "\n" not in text
    assert parse_speculative_config(text) == config
    assert SpeculativeConfig(**config.to_dict()) == config


ERRORS = [
    # (JSON, words the one-line message must contain)
    ("{", ["not valid JSON"]),
    ("[1, 2]", ["JSON object", "list"]),
    ('"ngram"', ["JSON object", "str"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "foo": 1, "bar": 2}',
     ["unknown key(s) bar, foo", "known keys: method, num_speculative_tokens"]),
    ('{"num_speculative_tokens": 2}', ["method is required"]),
    ('{"method": "eagle", "num_speculative_tokens": 2}', ["method", "ngram, draft_model"]),
    ('{"method": 3, "num_speculative_tokens": 2}', ["method must be a string"]),
    ('{"method": "ngram"}', ["num_speculative_tokens is required"]),
    ('{"method": "ngram", "num_speculative_tokens": 0}', ["num_speculative_tokens", "[1, 16]"]),
    ('{"method": "ngram", "num_speculative_tokens": 17}', ["num_speculative_tokens", "[1, 16]"]),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', ["num_speculative_tokens", "'4'"]),
    ('{"method": "ngram", "num_speculative_tokens": 4.0}', ["num_speculative_tokens", "4.0"]),
    ('{"method": "ngram", "num_speculative_tokens": true}', ["num_speculative_tokens", "True"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}',
     ["prompt_lookup_min", "[1, 32]"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 33}',
     ["prompt_lookup_max", "[1, 32]"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "3"}',
     ["prompt_lookup_max", "integer"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,'
     ' "prompt_lookup_max": 3}', ["prompt_lookup_min (4) must be <= prompt_lookup_max (3)"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}',
     ["model is for method draft_model"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_draft_layers": 1}',
     ["num_draft_layers is for method draft_model"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}',
     ["disable_by_batch_size", ">= 2"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 2.5}',
     ["disable_by_batch_size", "integer"]),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', ["model", "non-empty string"]),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": " "}',
     ["model", "non-empty string"]),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": 5}',
     ["model must be a string"]),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": "/m",'
     ' "prompt_lookup_max": 3}', ["prompt_lookup_max is for method ngram"]),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": "/m",'
     ' "num_draft_layers": 0}', ["num_draft_layers", ">= 1"]),
]  # fmt: skip


@pytest.mark.parametrize("text, words", ERRORS)
def test_every_error_is_one_clear_line(text, words):
    with pytest.raises(ValueError) as info:
        parse_speculative_config(text)
    message = str(info.value)
    assert message.startswith("--speculative-config: ")
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


def test_direct_construction_checks_too():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=1)
