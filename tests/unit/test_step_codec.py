"""The scheduler's protobuf conversions (the model description) and the worker's entry for a
new request (its sampling with the request's stop tokens)."""

from dataclasses import fields

from common.pb.tandem.internal.v1 import types_pb2
from common.pb.tandem.v1 import generate_pb2
from common.sampling import SamplingParams
from services.scheduler.request import Request
from services.scheduler.step_codec import model_from_pb, model_to_pb
from services.scheduler.step_plan import new_request_data
from services.scheduler.worker_types import ModelShape


def test_model_shape_mirrors_the_model_description_both_ways():
    assert {f.name for f in fields(ModelShape)} == {
        f.name for f in types_pb2.ModelDescription.DESCRIPTOR.fields
    }
    pb = types_pb2.ModelDescription(
        name="m", architecture="llama", vocab_size=10, max_model_len=64, eos_token_ids=[2, 3],
        dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8,
    )  # fmt: skip
    shape = model_from_pb(pb)
    assert shape.eos_token_ids == (2, 3) and shape.max_model_len == 64
    assert model_to_pb(shape) == pb


def test_the_worker_gets_the_requests_stop_tokens_inside_its_sampling():
    request = Request(
        "r", [1, 2], 4, sampling=SamplingParams(min_tokens=2, seed=5), stop_token_ids={9, 3}
    )
    sampling = new_request_data(request, [0], 0, 2, 0).sampling
    assert sampling.stop_token_ids == (3, 9)
    assert (sampling.min_tokens, sampling.seed, sampling.logprobs) == (2, 5, None)


def test_a_requests_constraint_reaches_the_worker_as_it_was_given():
    """Structured output: scheduler Request -> NewRequest -> the worker's
    NewRequestData, for every kind of constraint."""
    from common.structured_output import Constraint, constraint_from_pb, constraint_to_pb

    for constraint in [
        Constraint("json_schema", '{"type": "object"}'),
        Constraint("json_object"),
        Constraint("regex", "[a-z]+"),
        Constraint("grammar", 'root ::= "a"'),
        Constraint.choice(["yes", "no"]),
        None,
    ]:
        message = generate_pb2.StructuredOutput()
        constraint_to_pb(constraint, message)
        wire = generate_pb2.StructuredOutput.FromString(message.SerializeToString())
        assert constraint_from_pb(wire) == constraint
