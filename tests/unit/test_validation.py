"""Gateway validation, pure: documented defaults and resolved values (every error row of
docs/api.md goes through the real gateway in tests/service/test_api_validation.py)."""

from common.pb.tandem.v1 import generate_pb2
from common.sampling import API_DEFAULT_TEMPERATURE, SamplingParams
from services.gateway.validation import (
    ModelLimits,
    Stopping,
    resolve_max_tokens,
    validate_count,
    validate_sampling,
    validate_stopping,
)

LIMITS = ModelLimits(vocab_size=100, max_model_len=64, default_max_tokens=16)


def test_unset_fields_take_documented_defaults():
    # SamplingParams' defaults, but the public API's temperature (docs/api.md: 1.0).
    assert API_DEFAULT_TEMPERATURE == 1.0
    assert validate_sampling(generate_pb2.SamplingParams(), LIMITS) == SamplingParams(
        temperature=1.0
    )
    assert validate_stopping(generate_pb2.StoppingParams(), LIMITS, 8) == Stopping()
    assert Stopping().skip_special_tokens is True
    request = generate_pb2.GenerateRequest(text="x")
    assert resolve_max_tokens(request, 10, LIMITS) == 16
    assert resolve_max_tokens(request, 60, LIMITS) == 4  # capped by the context
    assert validate_count(request, "n", 1, 16, 1) == 1
    assert validate_count(request, "logprobs", 0, 20, None) is None


def test_explicit_values_pass_through_resolved():
    params = generate_pb2.SamplingParams(
        temperature=0,
        top_p=0.5,
        top_k=-1,
        min_p=0.1,
        repetition_penalty=1.2,
        presence_penalty=-0.5,
        frequency_penalty=2,
        logit_bias={7: -100.0, 3: 2.5},
        seed=2**64 - 1,
    )
    assert validate_sampling(params, LIMITS) == SamplingParams(
        temperature=0.0,
        top_p=0.5,
        top_k=0,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=-0.5,
        frequency_penalty=2.0,
        logit_bias=((3, 2.5), (7, -100.0)),
        seed=2**64 - 1,
    )
    stopping = generate_pb2.StoppingParams(
        stop=["a", "bc"],
        include_stop_str_in_output=True,
        stop_token_ids=[5, 5, 9],
        ignore_eos=True,
        min_tokens=8,
        skip_special_tokens=False,
    )
    assert validate_stopping(stopping, LIMITS, 8) == Stopping(
        stop=("a", "bc"),
        include_stop_str_in_output=True,
        stop_token_ids=(5, 9),
        ignore_eos=True,
        min_tokens=8,
        skip_special_tokens=False,
    )
    request = generate_pb2.GenerateRequest(text="x", max_tokens=54, n=16, logprobs=0)
    assert resolve_max_tokens(request, 10, LIMITS) == 54
    assert validate_count(request, "n", 1, 16, 1) == 16
    assert validate_count(request, "logprobs", 0, 20, None) == 0
