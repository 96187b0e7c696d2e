"""Where a sampled Python stack's time goes, by the component that owns it: the rules that
turn py-spy's collapsed stacks into the rows of the profile table (model, attention,
sampler, protobuf, gRPC, scheduler bookkeeping, detokenization, HTTP, ...). Pure.

A stack's category is decided from its innermost frame outwards: the first frame that a
rule recognises wins, so time inside protobuf called from the scheduler counts as protobuf,
and time in the scheduler's own Python counts as bookkeeping.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

# (category, substrings of a py-spy frame "function (path:line)"); first match wins.
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gRPC", ("grpc/", "grpc_", "cygrpc", "_cython/")),
    ("protobuf", ("google/protobuf", "_pb2", "_pb (", "from_pb (", "_to_pb (", "pb_ (")),
    ("attention", ("kernels/", "attention_backend.py", "cpu_attention")),
    ("sampler", ("worker/sampler.py", "logits_processors.py", "seeded_noise.py", "logprobs.py")),
    ("model", ("worker/models/", "torch/nn/", "cpu_decode", "_dynamo", "_inductor")),
    (
        "step inputs",
        ("attention_metadata.py", "worker/batch.py", "worker/runner.py", "step_inputs"),
    ),
    ("KV transfer", ("kv_transfer.py", "kv_message_io.py", "ucxx", "ucp/")),
    ("scheduler bookkeeping", ("services/scheduler/",)),
    ("detokenization", ("detokenizer.py", "tokenizers", "gateway/prompts.py")),
    ("stop strings + output", ("gateway/output.py", "stop_strings.py")),
    ("HTTP", ("starlette/", "uvicorn/", "h11/", "httptools", "openai_api/", "json/", "anyio/")),
    ("logging", ("structlog", "logging/", "common/log.py")),
    ("event loop", ("asyncio/", "selectors.py", "uvloop")),
)
OTHER = "other Python"


def categorize(frames: list[str]) -> str:
    """The category of one stack (outermost frame first, as py-spy writes them)."""
    for frame in reversed(frames):
        for category, needles in RULES:
            if any(needle in frame for needle in needles):
                return category
    return OTHER


def category_samples(stacks: Iterable[tuple[list[str], int]]) -> Counter:
    counts: Counter = Counter()
    for frames, count in stacks:
        counts[categorize(frames)] += count
    return counts
