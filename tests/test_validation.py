"""Gateway validation of GenerateRequest fields (pure; the e2e test covers the gRPC path)."""

import math

import pytest

from common.pb.tandem.v1 import generate_pb2
from services.gateway.validation import (
    InvalidArgumentError,
    ModelLimits,
    check_prompt_field,
    resolve_max_tokens,
    validate_prompt_ids,
    validate_prompt_text,
    validate_sampling,
)

LIMITS = ModelLimits(vocab_size=100, max_model_len=64, default_max_tokens=16)


def test_unset_fields_take_documented_defaults():
    sampling = validate_sampling(generate_pb2.SamplingParams())
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 1.0, 0)
    request = generate_pb2.GenerateRequest(text="x")
    assert resolve_max_tokens(request, 10, LIMITS) == 16
    assert resolve_max_tokens(request, 60, LIMITS) == 4  # capped by the context


def test_explicit_values_pass_through():
    sampling = validate_sampling(generate_pb2.SamplingParams(temperature=0, top_p=0.5, top_k=-1))
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.0, 0.5, 0)
    request = generate_pb2.GenerateRequest(text="x", max_tokens=54)
    assert resolve_max_tokens(request, 10, LIMITS) == 54


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: check_prompt_field(generate_pb2.GenerateRequest()), "prompt is required"),
        (lambda: validate_prompt_text(""), "prompt.text must not be empty"),
        (lambda: validate_prompt_text("x" * (4 * 2**20 + 1)), "at most 4194304 bytes"),
        (lambda: validate_prompt_ids([], LIMITS, "f"), "f must not be empty"),
        (
            lambda: validate_prompt_ids([5, 100], LIMITS, "f"),
            "f[1]=100 is outside the vocabulary [0, 100)",
        ),
        (lambda: validate_prompt_ids([-3], LIMITS, "f"), "f[0]=-3 is outside"),
        (
            lambda: resolve_max_tokens(generate_pb2.GenerateRequest(max_tokens=0), 3, LIMITS),
            "max_tokens must be >= 1, got 0",
        ),
        (
            lambda: resolve_max_tokens(generate_pb2.GenerateRequest(max_tokens=62), 3, LIMITS),
            "prompt (3 tokens) + max_tokens (62) must not exceed the context length of 64",
        ),
        (lambda: resolve_max_tokens(generate_pb2.GenerateRequest(), 64, LIMITS), "leaves no room"),
        (
            lambda: validate_sampling(generate_pb2.SamplingParams(temperature=-0.1)),
            "sampling.temperature",
        ),
        (
            lambda: validate_sampling(generate_pb2.SamplingParams(temperature=math.inf)),
            "sampling.temperature",
        ),
        (lambda: validate_sampling(generate_pb2.SamplingParams(temperature=101)), "[0, 100]"),
        (
            lambda: validate_sampling(generate_pb2.SamplingParams(top_p=1.5)),
            "sampling.top_p must be in (0, 1]",
        ),
        (lambda: validate_sampling(generate_pb2.SamplingParams(top_p=math.nan)), "sampling.top_p"),
        (
            lambda: validate_sampling(generate_pb2.SamplingParams(top_k=-7)),
            "sampling.top_k must be >= -1",
        ),
    ],
)
def test_each_bad_field_is_named_with_its_limit(call, message):
    with pytest.raises(InvalidArgumentError) as caught:
        call()
    assert message in str(caught.value)
