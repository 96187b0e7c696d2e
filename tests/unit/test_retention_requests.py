"""`kv_retention_s` on the way in: the HTTP front reads it as a top-level field or in
vLLM's `vllm_xargs` (other keys there, or two different values, are 400s naming the
field); the gateway and the scheduler refuse a value that is not finite, negative or over
--max-kv-retention-s, naming the field and the limit; unset is no retention."""

from __future__ import annotations

import pytest

from common.config import load_config
from common.pb.tandem.internal.v1 import scheduler_pb2
from common.pb.tandem.v1 import generate_pb2
from common.retention import RetentionLimits
from services.gateway.validation import InvalidArgumentError, validate_retention
from services.openai_api.chat_request import parse_chat
from services.openai_api.completion_request import parse_completion
from services.openai_api.errors import ApiError
from services.scheduler.admission import InvalidRequestError
from services.scheduler.config import SchedulerConfig
from services.scheduler.server import samples_from_pb


def completion(**extra) -> generate_pb2.GenerateRequest:
    (request,) = parse_completion({"prompt": "x", **extra}).requests
    return request


def test_http_reads_the_top_level_field_and_vllm_xargs():
    assert not completion().HasField("kv_retention_s")
    assert completion(kv_retention_s=120).kv_retention_s == 120.0
    assert completion(vllm_xargs={"kv_retention_s": 30.5}).kv_retention_s == 30.5
    assert completion(kv_retention_s=5, vllm_xargs={"kv_retention_s": 5}).kv_retention_s == 5
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "kv_retention_s": 9})
    assert chat.request.kv_retention_s == 9.0


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"kv_retention_s": "long"}, "kv_retention_s", "must be a number, got string"),
        ({"vllm_xargs": {"kv_retention_s": True}}, "vllm_xargs.kv_retention_s", "a number"),
        ({"vllm_xargs": {"other": 1}}, "vllm_xargs.other", "unknown or unsupported"),
        ({"vllm_xargs": [1]}, "vllm_xargs", "must be a JSON object"),
        (
            {"kv_retention_s": 5, "vllm_xargs": {"kv_retention_s": 6}},
            "kv_retention_s",
            "given twice, differently",
        ),
    ],
)
def test_http_refuses_bad_shapes_naming_the_field(extra, param, words):
    with pytest.raises(ApiError) as caught:
        completion(**extra)
    assert caught.value.status == 400 and caught.value.param == param
    assert words in caught.value.message


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5, 3600.001])
def test_the_gateway_refuses_out_of_limits_naming_field_and_limit(value):
    request = generate_pb2.GenerateRequest(kv_retention_s=value)
    with pytest.raises(InvalidArgumentError, match="kv_retention_s must be"):
        validate_retention(request, RetentionLimits(3600.0))


def test_the_gateway_passes_valid_values_and_unset_is_none():
    limits = RetentionLimits(3600.0)
    assert validate_retention(generate_pb2.GenerateRequest(), limits) == 0.0
    assert validate_retention(generate_pb2.GenerateRequest(kv_retention_s=3600), limits) == 3600
    with pytest.raises(InvalidArgumentError, match=r"<= 10 \(--max-kv-retention-s\)"):
        validate_retention(generate_pb2.GenerateRequest(kv_retention_s=11), RetentionLimits(10))


def test_the_scheduler_checks_again_and_every_sample_carries_it():
    submit = scheduler_pb2.SubmitRequest(
        request_id="r", prompt_token_ids=[1, 2], max_tokens=2, n=2, kv_retention_s=30
    )
    samples = samples_from_pb(submit, 64, RetentionLimits(60))
    assert [s.kv_retention_s for s in samples] == [30.0, 30.0]
    submit.kv_retention_s = 61
    with pytest.raises(InvalidRequestError, match=r"kv_retention_s must be <= 60"):
        samples_from_pb(submit, 64, RetentionLimits(60))


def test_the_limit_is_a_checked_setting():
    config = load_config(
        SchedulerConfig, ["--workers", "127.0.0.1:1", "--max-kv-retention-s", "60"], env={}
    )
    assert config.max_kv_retention_s == 60.0
    default = load_config(SchedulerConfig, ["--workers", "127.0.0.1:1"], env={})
    assert default.max_kv_retention_s == 3600
    with pytest.raises(ValueError, match="max_kv_retention_s must be finite and >= 0"):
        load_config(
            SchedulerConfig, ["--workers", "127.0.0.1:1", "--max-kv-retention-s", "-1"], env={}
        )
