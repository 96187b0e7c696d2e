"""The one sampling module: `SamplingParams`' defaults and limits, and the protobuf
conversions of `common/sampling_pb.py` (unset optional fields stay unset, the per-sample
seed offset, logprob alternatives, worker roles)."""

import dataclasses
import math

import pytest

from common.pb.tandem.internal.v1 import scheduler_pb2, types_pb2
from common.pb.tandem.v1 import generate_pb2
from common.sampling import MAX_LOGPROBS, MAX_SAMPLES, Logprob, SamplingParams
from common.sampling_pb import (
    ROLE_FROM_PB,
    ROLE_TO_PB,
    logprob_from_pb,
    logprob_to_pb,
    sampling_from_pb,
    sampling_to_pb,
)
from services.scheduler.server import samples_from_pb

# Values a float32 holds exactly, so they survive the wire unchanged.
FULL = SamplingParams(
    temperature=0.5,
    top_p=0.75,
    top_k=40,
    min_p=0.125,
    repetition_penalty=1.25,
    presence_penalty=-0.5,
    frequency_penalty=0.25,
    logit_bias=((3, -1.5), (7, 2.0)),
    seed=2**64 - 1,
    min_tokens=4,
    stop_token_ids=(9, 2),
    logprobs=0,
    prompt_logprobs=MAX_LOGPROBS,
)


def test_one_set_of_defaults_every_setting_off():
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert defaults == {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logit_bias": (),
        "seed": None,
        "min_tokens": 0,
        "stop_token_ids": (),
        "logprobs": None,
        "prompt_logprobs": None,
    }
    params = SamplingParams()
    assert params.is_greedy and not params.has_penalties and not params.has_processors
    assert (MAX_SAMPLES, MAX_LOGPROBS) == (16, 20)
    assert not SamplingParams(temperature=0.7).is_greedy
    assert SamplingParams(min_tokens=1).has_processors
    assert SamplingParams(frequency_penalty=0.1).has_penalties


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -0.1}, "temperature must be a finite number in [0, 100], got -0.1"),
        ({"temperature": 101.0}, "temperature must be a finite number in [0, 100]"),
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_p": math.nan}, "top_p must be in (0, 1]"),
        ({"top_k": -1}, "top_k must be >= 0 (0 = off), got -1"),
        ({"min_p": 1.5}, "min_p must be a finite number in [0, 1], got 1.5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 10] (1 = off), got 0.0"),
        ({"repetition_penalty": 11.0}, "repetition_penalty must be in (0, 10]"),
        ({"presence_penalty": 2.5}, "presence_penalty must be a finite number in [-2, 2]"),
        ({"frequency_penalty": -math.inf}, "frequency_penalty must be a finite number in [-2, 2]"),
        (
            {"logit_bias": tuple((t, 1.0) for t in range(301))},
            "logit_bias must have at most 300 entries, got 301",
        ),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias key -1 is not a token id"),
        ({"logit_bias": ((5, 100.5),)}, "logit_bias[5] must be a finite number in [-100, 100]"),
        ({"seed": -1}, "seed must be in [0, 2**64), got -1"),
        ({"seed": 2**64}, "seed must be in [0, 2**64)"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        # Clients may ask 20 (the gateway checks); beam search asks a worker for more.
        ({"logprobs": 65}, "logprobs must be in [0, 64], got 65"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be in [0, 20], got -1"),
    ],
)
def test_values_out_of_their_limits_are_refused(fields, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**fields)
    assert message in str(error.value)


def test_limits_are_inclusive_where_documented():
    SamplingParams(
        temperature=100.0,
        top_p=1.0,
        min_p=1.0,
        repetition_penalty=10.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        logit_bias=((0, -100.0), (1, 100.0)),
        seed=0,
        logprobs=20,
        prompt_logprobs=0,
    )


def test_round_trip_keeps_every_field():
    pb = sampling_to_pb(FULL)
    assert list(pb.stop_token_ids) == [9, 2] and dict(pb.params.logit_bias) == {3: -1.5, 7: 2.0}
    assert sampling_from_pb(pb) == FULL
    assert sampling_from_pb(types_pb2.Sampling.FromString(pb.SerializeToString())) == FULL


def test_unset_optional_fields_stay_unset():
    pb = sampling_to_pb(SamplingParams())
    assert not pb.params.HasField("seed")
    for name in ("logprobs", "prompt_logprobs"):
        assert not pb.HasField(name)
    assert sampling_from_pb(pb) == SamplingParams()
    # Set to zero is still set.
    pb = sampling_to_pb(SamplingParams(seed=0, logprobs=0, prompt_logprobs=0))
    assert pb.params.HasField("seed") and pb.HasField("logprobs")
    assert pb.HasField("prompt_logprobs")
    assert sampling_from_pb(pb) == SamplingParams(seed=0, logprobs=0, prompt_logprobs=0)


def test_every_setting_travels_set_so_unset_means_off_and_zero_is_zero():
    pb = sampling_to_pb(SamplingParams())
    assert all(pb.params.HasField(name) for name in ("temperature", "top_p", "top_k"))
    assert sampling_from_pb(types_pb2.Sampling()) == SamplingParams()
    zero = types_pb2.Sampling(params=generate_pb2.SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="top_p must be in"):
        sampling_from_pb(zero)  # a zero is a zero, not "off"


def test_out_of_limit_message_is_refused_when_read():
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        sampling_from_pb(types_pb2.Sampling(params=generate_pb2.SamplingParams(top_k=-2)))


def test_sample_i_draws_with_seed_plus_i_and_only_sample_0_scores_the_prompt():
    pb = sampling_to_pb(SamplingParams(temperature=1.0, seed=2**64 - 2, prompt_logprobs=3))
    assert sampling_from_pb(pb, seed_offset=3).seed == 1  # mod 2**64
    assert sampling_from_pb(pb, 1, with_prompt_logprobs=False).prompt_logprobs is None
    request = scheduler_pb2.SubmitRequest(
        request_id="r", prompt_token_ids=[1, 2], max_tokens=4, sampling=pb, n=3
    )
    samples = samples_from_pb(request, max_model_len=64)
    assert [s.sampling.seed for s in samples] == [2**64 - 2, 2**64 - 1, 0]
    assert [s.sampling.prompt_logprobs for s in samples] == [3, None, None]
    assert [s.request_id for s in samples] == ["r/0", "r/1", "r/2"]
    unseeded = scheduler_pb2.SubmitRequest(
        request_id="u", prompt_token_ids=[1], max_tokens=1, sampling=sampling_to_pb(FULL), n=2
    )
    unseeded.sampling.params.ClearField("seed")
    assert [s.sampling.seed for s in samples_from_pb(unseeded, 64)] == [None, None]


def test_too_many_samples_are_refused():
    request = scheduler_pb2.SubmitRequest(
        request_id="r", prompt_token_ids=[1], max_tokens=1, n=MAX_SAMPLES + 1
    )
    with pytest.raises(ValueError, match="n must be in 1..16, got 17"):
        samples_from_pb(request, 64)


def test_logprob_round_trip_keeps_the_alternatives_in_order():
    entry = Logprob(11, -0.25, ((11, -0.25), (4, -1.5), (9, -3.0)))
    pb = logprob_to_pb(entry)
    assert [(t.token_id, t.logprob) for t in pb.top_logprobs] == [(11, -0.25), (4, -1.5), (9, -3.0)]
    assert logprob_from_pb(pb) == entry
    bare = Logprob(3, -0.5)
    assert len(logprob_to_pb(bare).top_logprobs) == 0
    assert logprob_from_pb(logprob_to_pb(bare)) == bare


def test_worker_roles_both_ways():
    assert set(ROLE_TO_PB) == {"prefill", "decode", "both"}
    for role, pb in ROLE_TO_PB.items():
        assert ROLE_FROM_PB[pb] == role
    assert ROLE_TO_PB["both"] == types_pb2.WORKER_ROLE_BOTH
    assert types_pb2.WORKER_ROLE_UNSPECIFIED not in ROLE_FROM_PB
