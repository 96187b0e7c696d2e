"""The worker's protobuf edges for sampling: every field of the internal `Sampling` (the
public SamplingParams inside it) resolved into `SamplingParams` (unset settings -> off,
unset logprobs -> None), and step results with logprobs only where a request asked."""

from common.pb.tandem.internal.v1 import types_pb2
from common.pb.tandem.v1 import generate_pb2
from common.sampling import Logprob, SamplingParams
from common.sampling_pb import sampling_from_pb
from common.step_result import KvLoadDone, PromptLogprobs, SpecOutcome, StepResult
from common.step_result_pb import result_from_pb, result_to_pb


def test_every_field_is_parsed():
    params = generate_pb2.SamplingParams(
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.2,
        presence_penalty=-0.5,
        frequency_penalty=0.25,
        logit_bias={7: 2.0, 3: -1.5},
        seed=2**64 - 1,
    )
    pb = types_pb2.Sampling(
        params=params,
        min_tokens=4,
        stop_token_ids=[2, 9],
        logprobs=0,
        prompt_logprobs=5,
    )
    assert sampling_from_pb(pb) == SamplingParams(
        temperature=0.5,
        top_p=0.8999999761581421,  # float32 on the wire
        top_k=40,
        min_p=0.05000000074505806,
        repetition_penalty=1.2000000476837158,
        presence_penalty=-0.5,
        frequency_penalty=0.25,
        logit_bias=((3, -1.5), (7, 2.0)),
        seed=2**64 - 1,
        min_tokens=4,
        stop_token_ids=(2, 9),
        logprobs=0,
        prompt_logprobs=5,
    )


def test_unset_fields_resolve_to_off():
    parsed = sampling_from_pb(types_pb2.Sampling())
    assert parsed == SamplingParams(top_p=1.0, repetition_penalty=1.0)
    assert parsed.seed is None and parsed.logprobs is None and parsed.prompt_logprobs is None
    seeded = types_pb2.Sampling(params=generate_pb2.SamplingParams(seed=0))
    assert sampling_from_pb(seeded).seed == 0  # set, even if 0


def test_step_response_carries_logprobs_only_where_asked():
    entry = Logprob(11, -0.25, ((11, -0.25), (4, -1.5)))
    output = StepResult(
        step_id=9,
        sampled={"a": 11, "b": 3},
        execute_seconds=0.01,
        logprobs={"a": entry},
        prompt_logprobs={"c": PromptLogprobs(14, (Logprob(8, -2.0), entry))},
    )
    pb = result_to_pb(output)
    a, b = pb.sampled_tokens
    assert (a.request_id, a.token_id, b.request_id, b.token_id) == ("a", 11, "b", 3)
    assert a.HasField("logprob") and not b.HasField("logprob")
    assert a.logprob.logprob == -0.25
    assert [(t.token_id, t.logprob) for t in a.logprob.top_logprobs] == [(11, -0.25), (4, -1.5)]
    (prompt,) = pb.prompt_logprobs
    assert (prompt.request_id, prompt.start) == ("c", 14)
    assert [e.token_id for e in prompt.entries] == [8, 11]
    assert pb.step_id == 9


def test_step_result_round_trips_through_the_wire():
    """What a worker sends the scheduler, and the last pipeline stage the other ranks: the
    same result, logprobs, prompt logprobs, verified proposals, draining and the KV loads
    that ended included."""

    entry = Logprob(11, -0.25, ((11, -0.25), (4, -1.5)))
    output = StepResult(
        step_id=4,
        sampled={"a": 11, "b": 3, "s": 8},
        execute_seconds=0.5,
        logprobs={"a": entry},
        prompt_logprobs={"c": PromptLogprobs(14, (Logprob(8, -2.0), entry))},
        spec={"s": SpecOutcome([5, 6], 3, [None, None]), "b": SpecOutcome([], 2, [])},
        draining=True,
        kv_loads_done=(
            KvLoadDone(0xFFFF_0000_0000_0002, 4096, 0.25, 0.125),
            KvLoadDone(3, error="the peer exited", pull_refused=True),
        ),
    )
    assert result_from_pb(result_to_pb(output)) == output
    assert result_from_pb(result_to_pb(StepResult(1, {}, 0.0))) == StepResult(1, {}, 0.0)
