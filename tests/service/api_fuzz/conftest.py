"""The API fuzz modules' fixtures, each module's own: a channel to the shared `api_stack`'s
gateway (checked to serve the tiny checkpoint the oracle assumes), its stub, the documented
error texts, and each service log's size before the module's first request."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from tests.service.api_fuzz.request_strategies import (
    MAX_LEN,
    VOCAB,
)
from tests.service.test_api_validation import documented_messages


@pytest.fixture(scope="module")
def channel(api_stack):
    with grpc.insecure_channel(api_stack.spec.gateway_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
        assert (info.vocab_size, info.max_model_len) == (VOCAB, MAX_LEN)
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return generate_pb2_grpc.GenerateServiceStub(channel)


@pytest.fixture(scope="module")
def documented():
    from tests.service.test_e2e_beam_search import beam_documented_messages

    return (
        documented_messages()
        + beam_documented_messages()
        + documented_messages("tools-validation-table")
    )


@pytest.fixture(scope="module")
def log_marks(api_stack) -> dict[Path, int]:
    """Each service log's size before this module's first request."""
    return {path: path.stat().st_size for path in (api_stack.run_dir / "logs").glob("*.log")}
