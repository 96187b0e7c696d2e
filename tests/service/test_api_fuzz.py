"""Negative fuzzing of the public API on the real stack (gateway, scheduler, prefill and
decode worker on the tiny llama), with hypothesis (derandomized, so CI runs the same inputs):

- structured: `GenerateRequest`s built over the whole message (every prompt kind with odd
  unicode, control characters, huge and empty strings, out-of-vocabulary ids; every
  sampling and stopping field at 0, negative, nan, inf, huge, tiny; `n`, logprobs,
  `max_tokens`, `cache_salt`), alone and in concurrent batches beside a greedy and a
  seeded request whose tokens must not change; and `Tokenize` / `Detokenize` requests;
- wire level: random bytes and truncated / mutated serialisations of valid requests;
- oversize: messages around the gateway's 64 MiB receive limit, and large prompts (the
  gateway must keep answering other calls while it tokenizes them);
- HTTP: JSON bodies for the OpenAI front's /v1/completions and /v1/chat/completions.

Every call ends, within its deadline, either OK (each sample ends with a finish reason) or
INVALID_ARGUMENT whose message is a row of docs/api.md's validation table naming the field
(RESOURCE_EXHAUSTED for an oversize message): never UNKNOWN, INTERNAL, UNAVAILABLE,
DEADLINE_EXCEEDED. An independent oracle written from the documented limits says which
requests must fail and which fields may be named. Afterwards the stack is unharmed: every
pool back to all-free, every service alive, nothing logged as an error, and greedy output
still equals `transformers` token for token.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.config import parse_size
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from services.gateway.config import GatewayConfig
from tests.hf_reference import hf_generate, hf_tokenizer
from tests.service.test_api_validation import documented_messages
from tests.stack_client import generate, greedy_request, http_front, wait_until_idle

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 20.0
# The tiny checkpoint (checked against GetModelInfo by the fixture).
VOCAB = 1024
MAX_LEN = 512
# docs/api.md's limits, written out again so the oracle does not share the gateway's code.
MAX_TEXT_BYTES = 4 * 1024 * 1024
ROLES = ("system", "user", "assistant", "tool")
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT64 = (0, 2**64 - 1)
MALFORMED = "the request is not a valid protobuf message"
# What a call may end with; anything else (UNKNOWN, INTERNAL, UNAVAILABLE, DEADLINE_EXCEEDED,
# CANCELLED...) is a bug.
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FINISHED = {generate_pb2.FINISH_REASON_STOP, generate_pb2.FINISH_REASON_LENGTH}

FUZZ = dict(
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)

# ---------------------------------------------------------------------------------------
# Strategies


def weighted(*pairs: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """one_of with integer weights (a branch listed k times is drawn about k times as often)."""
    return st.one_of([strategy for weight, strategy in pairs for _ in range(weight)])


def optional(valid: list, anything: st.SearchStrategy, hostile: bool = True) -> st.SearchStrategy:
    """Unset (None) most often, else a valid edge value, else (when hostile) anything the
    type holds."""
    if not hostile:
        return weighted((3, st.none()), (2, st.sampled_from(valid)))
    return weighted((3, st.none()), (2, st.sampled_from(valid)), (1, anything))


any_char = st.characters(codec="utf-8")  # every code point but surrogates (not encodable)
odd_char = st.characters(codec="utf-8", categories=["Cc", "Cf", "Co", "Mn", "Zl", "Zp", "Zs"])
EDGE_TEXTS = [
    "",
    " ",
    "\x00",
    "\x00" * 64,
    "</s>",
    "<s>",
    "<unk>",
    "<s></s><unk></s>",
    "\ufeff\u200b\u202e\u2066",
    "\U0010ffff\U000e0001",
    "🚀" * 40,
    "e\u0301" * 30,
    "\r\n\t\x0b\x0c\x1b[31m",
    "中文 naïve café ﷽",
    "ab " * 3000,  # far past the context length once tokenized
    "hello world " * 6000,  # tokenized on a thread (over 64 KiB)
    "x" * (MAX_TEXT_BYTES + 1),  # one byte over the text limit
    "é" * (MAX_TEXT_BYTES // 2 + 1),  # under the limit in characters, over it in bytes
]
texts = weighted(
    (3, st.text(any_char, max_size=40)),
    (1, st.text(odd_char, max_size=20)),
    (2, st.sampled_from(EDGE_TEXTS)),
)
EDGE_IDS = [-1, -2, INT64[0], INT64[1], VOCAB, VOCAB + 1, 2**31, -(2**31), 2**32]
any_id = weighted(
    (3, st.integers(0, VOCAB - 1)), (1, st.sampled_from(EDGE_IDS)), (1, st.integers(*INT64))
)
in_vocab_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
token_id_lists = weighted(
    (3, in_vocab_ids),
    (2, st.lists(any_id, max_size=12)),
    (1, st.integers(MAX_LEN - 8, MAX_LEN + 4).map(lambda k: [7] * k)),
)
ODD_ROLES = ["", "User", "USER", "robot", "developer", "user ", "system\x00", "🤖", "tool" * 100]
roles = weighted(
    (4, st.sampled_from(ROLES)), (1, st.sampled_from(ODD_ROLES)), (1, st.text(max_size=8))
)
chat_messages = st.builds(generate_pb2.ChatMessage, role=roles, content=texts)
chats = weighted(
    (4, st.lists(chat_messages, max_size=5)),
    (1, st.just([generate_pb2.ChatMessage(role="user", content="hi")] * 1025)),
    (1, st.just([generate_pb2.ChatMessage(role="user", content="hi")] * 1024)),
)

NASTY_FLOATS = [math.nan, math.inf, -math.inf, -0.0, -1.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 1e10]
any_float = weighted(
    (1, st.sampled_from(NASTY_FLOATS)), (1, st.floats(width=32)), (1, st.floats(-3, 3, width=32))
)
any_int32 = weighted((1, st.sampled_from([INT32[0], INT32[1], -1, 0, 1])), (1, st.integers(*INT32)))
bias_values = st.sampled_from([-100.0, 100.0, 0.0, 1e-45, -1e-45, 50.0, -3.5])


# Every strategy is built once, for both modes: "lawful" (every field within its documented
# limit, at the edges) and "hostile" (anything the field's type holds, now and then).
MODES = (False, True)  # hostile?
SAMPLING_FIELDS = {
    hostile: {
        "temperature": optional(
            [0.0, 1e-45, 1e-38, 1e-6, 0.5, 1, 2, 99.99, 100], any_float, hostile
        ),
        "top_p": optional([1e-45, 1e-7, 0.1, 0.999, 1.0], any_float, hostile),
        "top_k": optional([-1, 0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, INT32[1]], any_int32, hostile),
        "min_p": optional([0.0, 1e-45, 0.5, 0.9999, 1.0], any_float, hostile),
        "repetition_penalty": optional([1e-45, 1e-7, 0.5, 1.0, 2.0, 10.0], any_float, hostile),
        "presence_penalty": optional([-2.0, -1e-45, 0.0, 1e-45, 2.0], any_float, hostile),
        "frequency_penalty": optional([-2.0, -1e-45, 0.0, 1e-45, 2.0], any_float, hostile),
        "seed": optional([0, 1, 2**63, UINT64[1]], st.integers(*UINT64)),
    }
    for hostile in MODES
}
valid_bias = st.dictionaries(st.integers(0, VOCAB - 1), bias_values, max_size=5)
LOGIT_BIAS = {
    hostile: weighted(
        (3, st.just({})),
        (2, valid_bias),
        (1, st.dictionaries(any_id, any_float, max_size=4) if hostile else valid_bias),
        (
            1,
            st.sampled_from([300, 301] if hostile else [300]).map(
                lambda k: dict.fromkeys(range(k), 100.0)
            ),
        ),
    )
    for hostile in MODES
}


@st.composite
def sampling_params(draw, hostile: bool) -> generate_pb2.SamplingParams:
    s = generate_pb2.SamplingParams()
    for name, strategy in SAMPLING_FIELDS[hostile].items():
        value = draw(strategy)
        if value is not None:
            setattr(s, name, value)
    s.logit_bias.update(draw(LOGIT_BIAS[hostile]))
    return s


short_stops = st.lists(st.text(st.sampled_from("e ta\n.,<>"), min_size=1, max_size=3), max_size=4)
valid_stop_lists = weighted(
    (3, st.just([])),
    (3, short_stops),
    (1, st.lists(st.text(any_char, min_size=1, max_size=256), max_size=3)),
    (1, st.just(["y" * 256] * 16)),
)
STOP_LISTS = {
    False: valid_stop_lists,
    True: weighted(
        (2, valid_stop_lists),
        (1, st.lists(texts.filter(lambda t: len(t) < 1000), max_size=5)),
        (1, st.sampled_from([["a"] * 17, ["y" * 257], ["ok", ""]])),
    ),
}
valid_stop_ids = weighted(
    (3, st.just([])),
    (2, st.lists(st.integers(0, VOCAB - 1), max_size=5)),
    (1, st.sampled_from([list(range(64)), [2] * 64])),
)
STOP_IDS = {
    False: valid_stop_ids,
    True: weighted(
        (2, valid_stop_ids), (1, st.lists(any_id, max_size=5)), (1, st.just(list(range(65))))
    ),
}
MIN_TOKENS = {hostile: optional([0, 1, 2, 4, 5], any_int32, hostile) for hostile in MODES}
optional_bools = st.one_of(st.none(), st.booleans())


@st.composite
def stopping_params(draw, hostile: bool) -> generate_pb2.StoppingParams:
    s = generate_pb2.StoppingParams(
        stop=draw(STOP_LISTS[hostile]),
        include_stop_str_in_output=draw(st.booleans()),
        stop_token_ids=draw(STOP_IDS[hostile]),
        ignore_eos=draw(st.booleans()),
    )
    min_tokens = draw(MIN_TOKENS[hostile])
    if min_tokens is not None:
        s.min_tokens = min_tokens
    skip = draw(optional_bools)
    if skip is not None:
        s.skip_special_tokens = skip
    return s


PROMPT_TEXTS = {False: texts.filter(lambda t: t and len(t) < 2**20), True: texts}
PROMPT_IDS = {False: in_vocab_ids, True: token_id_lists}
valid_chats = st.lists(
    st.builds(generate_pb2.ChatMessage, role=st.sampled_from(ROLES), content=PROMPT_TEXTS[False]),
    min_size=1,
    max_size=4,
)
CHATS = {False: valid_chats, True: chats}
PROMPT_KINDS = {
    hostile: ["text", "token_ids", "chat"] * 3 + ["none"] * hostile for hostile in MODES
}
# Generations stay short: max_tokens is small unless it is invalid anyway; left unset (until
# the context ends) only with a prompt that leaves at most a few tokens of room.
MAX_TOKENS_HOW = {
    hostile: ["small"] * 6 + ["medium", "unset"] + ["invalid"] * 2 * hostile for hostile in MODES
}
invalid_max_tokens = weighted(
    (1, st.sampled_from([0, -1, INT32[0], INT32[1], MAX_LEN, MAX_LEN + 1, 10**6])),
    (1, st.integers(*INT32).filter(lambda v: v < 1 or v > MAX_LEN)),
)
near_full_prompts = st.integers(MAX_LEN - 6, MAX_LEN + 2).map(lambda k: [7] * k)
COUNTS = {
    hostile: {
        "n": optional([1, 2, 16], any_int32, hostile),
        "logprobs": optional([0, 1, 20], any_int32, hostile),
        "prompt_logprobs": optional([0, 3, 20], any_int32, hostile),
    }
    for hostile in MODES
}
CACHE_SALTS = {
    hostile: weighted(
        (3, st.just("")),
        (1, st.text(any_char, max_size=20)),
        (1, st.sampled_from(["s" * 256, "é" * 128, "\x00"] + ["s" * 257, "é" * 129] * hostile)),
    )
    for hostile in MODES
}


BEAM_WIDTHS = {
    False: st.sampled_from([1, 2, 4, 8]),
    True: weighted((3, st.sampled_from([1, 2, 4, 8])), (1, any_int32)),
}
EARLY_STOPPING = {
    False: st.sampled_from([0, 1, 2, 3]),
    True: weighted((3, st.sampled_from([0, 1, 2, 3])), (1, st.sampled_from([4, 99, -1]))),
}


@st.composite
def beam_search_params(draw, hostile: bool) -> generate_pb2.BeamSearchParams:
    b = generate_pb2.BeamSearchParams(
        beam_width=draw(BEAM_WIDTHS[hostile]), early_stopping=draw(EARLY_STOPPING[hostile])
    )
    length_penalty = draw(optional([-0.5, 0.0, 1.0, 2.0], any_float, hostile))
    if length_penalty is not None:
        b.length_penalty = length_penalty
    return b


@st.composite
def generate_requests(draw) -> generate_pb2.GenerateRequest:
    """Half the requests lawful (they must succeed unless the prompt is too long for the
    context), half hostile."""
    hostile = draw(st.booleans())
    r = generate_pb2.GenerateRequest()
    kind = draw(st.sampled_from(PROMPT_KINDS[hostile]))
    how = draw(st.sampled_from(MAX_TOKENS_HOW[hostile]))
    if how == "unset":
        kind = "token_ids"
    if kind == "text":
        r.text = draw(PROMPT_TEXTS[hostile])
    elif kind == "token_ids":
        r.token_ids.SetInParent()
        r.token_ids.ids.extend(draw(near_full_prompts if how == "unset" else PROMPT_IDS[hostile]))
    elif kind == "chat":
        r.chat.SetInParent()
        r.chat.messages.extend(draw(CHATS[hostile]))
        add = draw(optional_bools)
        if add is not None:
            r.chat.add_generation_prompt = add
    if how == "small":
        r.max_tokens = draw(st.integers(1, 4))
    elif how == "medium":
        r.max_tokens = draw(st.integers(5, 12))
    elif how == "invalid":
        r.max_tokens = draw(invalid_max_tokens)
    if draw(st.booleans()):
        r.sampling.CopyFrom(draw(sampling_params(hostile)))
    if draw(st.booleans()):
        r.stopping.CopyFrom(draw(stopping_params(hostile)))
        if not hostile and r.stopping.HasField("min_tokens"):
            r.stopping.min_tokens = min(r.stopping.min_tokens, r.max_tokens)  # 0 when unset
    for name, strategy in COUNTS[hostile].items():
        value = draw(strategy)
        if value is not None:
            setattr(r, name, value)
    r.cache_salt = draw(CACHE_SALTS[hostile])
    if draw(st.integers(0, 5)) == 0:  # beam search, about one request in six
        r.beam_search.CopyFrom(draw(beam_search_params(hostile)))
        if not hostile:  # lawful: only what beam search takes
            r.ClearField("sampling")
            r.ClearField("logprobs")
            r.ClearField("prompt_logprobs")
            del r.stopping.stop[:]
            r.stopping.ClearField("min_tokens")
            r.n = draw(st.integers(1, r.beam_search.beam_width))
    return r


# ---------------------------------------------------------------------------------------
# The oracle: what docs/api.md says about a request, independently of the gateway's code.


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def documented_violations(r: generate_pb2.GenerateRequest) -> tuple[set[str], set[str]]:
    """(fields that break a documented limit: the call must fail; fields that may fail
    depending on the prompt's tokenization: the context length, min_tokens against the
    default max_tokens)."""
    certain: set[str] = set()
    possible = {"context"}
    which = r.WhichOneof("prompt")
    if which is None:
        certain.add("prompt")
    elif which == "text":
        if not r.text or utf8_len(r.text) > MAX_TEXT_BYTES:
            certain.add("prompt.text")
    elif which == "token_ids":
        ids = r.token_ids.ids
        if not ids or any(not 0 <= t < VOCAB for t in ids):
            certain.add("prompt.token_ids")
    else:
        messages = r.chat.messages
        if (
            not 1 <= len(messages) <= 1024
            or any(m.role not in ROLES for m in messages)
            or sum(utf8_len(m.content) for m in messages) > MAX_TEXT_BYTES
        ):
            certain.add("prompt.chat")
    if r.HasField("max_tokens") and r.max_tokens < 1:
        certain.add("max_tokens")

    s = r.sampling
    ranges = {
        "temperature": lambda v: 0 <= v <= 100,  # nan fails every comparison
        "top_p": lambda v: 0 < v <= 1,
        "top_k": lambda v: v >= -1,
        "min_p": lambda v: 0 <= v <= 1,
        "repetition_penalty": lambda v: 0 < v <= 10,
        "presence_penalty": lambda v: -2 <= v <= 2,
        "frequency_penalty": lambda v: -2 <= v <= 2,
    }
    for name, ok in ranges.items():
        if s.HasField(name) and not ok(getattr(s, name)):
            certain.add(f"sampling.{name}")
    bias = s.logit_bias
    if len(bias) > 300 or any(not 0 <= k < VOCAB or not -100 <= v <= 100 for k, v in bias.items()):
        certain.add("sampling.logit_bias")
    for name, low, high in (("n", 1, 16), ("logprobs", 0, 20), ("prompt_logprobs", 0, 20)):
        if r.HasField(name) and not low <= getattr(r, name) <= high:
            certain.add(name)

    stop = r.stopping
    if len(stop.stop) > 16 or any(not 1 <= len(x) <= 256 for x in stop.stop):
        certain.add("stopping.stop")
    ids = stop.stop_token_ids
    if len(ids) > 64 or any(not 0 <= t < VOCAB for t in ids):
        certain.add("stopping.stop_token_ids")
    if stop.HasField("min_tokens"):
        if stop.min_tokens < 0 or (r.HasField("max_tokens") and stop.min_tokens > r.max_tokens):
            certain.add("stopping.min_tokens")
        elif not r.HasField("max_tokens") and stop.min_tokens > 0:
            possible.add("stopping.min_tokens")
    if utf8_len(r.cache_salt) > 256:
        certain.add("cache_salt")
    if r.HasField("beam_search"):
        beam_violations(r, certain, possible)
    return certain, possible


# Values of the sampling fields that beam search accepts (docs/api.md, Beam search).
BEAM_SAMPLING_OFF = {
    "temperature": (0.0,),
    "top_p": (1.0,),
    "top_k": (0, -1),
    "min_p": (0.0,),
    "repetition_penalty": (1.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
}


def beam_violations(r: generate_pb2.GenerateRequest, certain: set, possible: set) -> None:
    """docs/api.md's beam search table."""
    b = r.beam_search
    width_ok = 1 <= b.beam_width <= 8
    if not width_ok:
        certain.add("beam_search.beam_width")
    if b.HasField("length_penalty") and not math.isfinite(b.length_penalty):
        certain.add("beam_search.length_penalty")
    if b.early_stopping not in (0, 1, 2, 3):
        certain.add("beam_search.early_stopping")
    n = r.n if r.HasField("n") else 1
    if width_ok and not 1 <= n <= b.beam_width:
        certain.add("n")
    s = r.sampling
    for name, off in BEAM_SAMPLING_OFF.items():
        if s.HasField(name) and getattr(s, name) not in off:
            certain.add(f"sampling.{name}")
    if s.logit_bias:
        certain.add("sampling.logit_bias")
    for name in ("logprobs", "prompt_logprobs"):
        if r.HasField(name):
            certain.add(name)
    if r.stopping.stop:
        certain.add("stopping.stop")
    if r.stopping.HasField("min_tokens") and r.stopping.min_tokens:
        certain.add("stopping.min_tokens")
    if r.HasField("structured_output"):
        certain.add("structured_output")
    possible.add("stopping.stop_token_ids")  # (1 + stop ids with EOS) * width <= 64


def error_field(details: str) -> str:
    """The field an INVALID_ARGUMENT message starts with ('context' for the length rows)."""
    if re.match(r"prompt \(\d+ tokens\)", details):
        return "context"
    head = re.match(r"[a-z_.]*[a-z_]", details)
    assert head, f"the error does not start with a field name: {details!r}"
    for prefix in ("prompt.token_ids", "prompt.chat", "prompt.text"):
        if head.group(0).startswith(prefix):
            return prefix
    return head.group(0)


# ---------------------------------------------------------------------------------------
# Calls and their checks


class Tally:
    """Outcomes per category, for the summary line."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.fields: Counter[str] = Counter()

    def add(self, outcome: str, field: str | None = None) -> None:
        self.counts[outcome] += 1
        if field:
            self.fields[field] += 1

    def line(self, name: str) -> str:
        total = sum(self.counts.values())
        parts = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        fields = len(self.fields)
        return f"fuzz {name}: {total} requests ({parts}); errors named {fields} distinct fields"


def call_stream(method, payload) -> tuple[grpc.StatusCode, str, list, float]:
    start = time.monotonic()
    messages = []
    try:
        for message in method(payload, timeout=DEADLINE_S):
            messages.append(message)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", messages, time.monotonic() - start
    return grpc.StatusCode.OK, "", messages, time.monotonic() - start


def call_unary(method, payload) -> tuple[grpc.StatusCode, str, object]:
    try:
        return grpc.StatusCode.OK, "", method(payload, timeout=DEADLINE_S)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", None


def check_documented(details: str, documented: list[str]) -> None:
    assert any(row in details for row in documented), f"undocumented error text: {details!r}"


def check_stream(r: generate_pb2.GenerateRequest, messages: list) -> None:
    """An OK Generate stream: every sample finished once, tokens within the limits."""
    assert messages, "an OK stream without a message"
    n = r.n if r.HasField("n") else 1
    finals: dict[int, int] = {}
    tokens: Counter[int] = Counter()
    prompt_logprobs = []
    for m in messages:
        assert 0 <= m.index < n, m
        assert m.index not in finals, f"sample {m.index} sent a message after its finish"
        tokens[m.index] += len(m.token_ids)
        assert all(0 <= t < VOCAB for t in m.token_ids), m.token_ids
        if r.HasField("logprobs"):
            assert len(m.logprobs) == len(m.token_ids)
            assert all(len(lp.top_logprobs) == r.logprobs for lp in m.logprobs)
            assert all(lp.logprob <= 0 for lp in m.logprobs), m.logprobs  # not nan either
            assert all(top.logprob <= 0 for lp in m.logprobs for top in lp.top_logprobs)
        else:
            assert not m.logprobs
        prompt_logprobs.extend(m.prompt_logprobs)
        if m.finish_reason:
            finals[m.index] = m.finish_reason
    assert sorted(finals) == list(range(n)), f"samples without a finish: {finals}"
    assert set(finals.values()) <= FINISHED, finals
    last = messages[-1]
    assert last.HasField("usage") and last.usage.prompt_tokens >= 1, last
    assert last.usage.completion_tokens == sum(tokens.values())
    assert last.usage.prompt_tokens + max(tokens.values(), default=0) <= MAX_LEN
    if r.HasField("max_tokens"):
        assert max(tokens.values(), default=0) <= r.max_tokens
    if r.HasField("prompt_logprobs"):
        assert len(prompt_logprobs) == last.usage.prompt_tokens - 1
        assert all(lp.logprob <= 0 for lp in prompt_logprobs), prompt_logprobs
        assert all(len(lp.top_logprobs) == r.prompt_logprobs for lp in prompt_logprobs)
    else:
        assert not prompt_logprobs


def check_generate_outcome(
    r: generate_pb2.GenerateRequest, code, details: str, messages: list, documented, tally
) -> None:
    certain, possible = documented_violations(r)
    assert code in ALLOWED, f"{code.name}: {details!r} for {summarize(r)}"
    if code == grpc.StatusCode.OK:
        assert not certain, f"accepted although {certain} break documented limits: {summarize(r)}"
        check_stream(r, messages)
        tally.add("ok")
    elif code == grpc.StatusCode.INVALID_ARGUMENT:
        assert not messages, "INVALID_ARGUMENT after the stream started"
        check_documented(details, documented)
        field = error_field(details)
        assert field in certain | possible, (
            f"error names {field!r} ({details!r}); documented violations: {certain}"
        )
        tally.add("invalid", field)
    else:
        assert details, "RESOURCE_EXHAUSTED without a message"
        tally.add("exhausted")


def summarize(r: generate_pb2.GenerateRequest) -> str:
    """A request, readable even when it holds a 4 MiB prompt."""
    text = str(r)
    return text if len(text) < 2000 else text[:1000] + f"... ({len(text)} chars)"


# ---------------------------------------------------------------------------------------
# Fixtures and the after-run check


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

    return documented_messages() + beam_documented_messages()


@pytest.fixture(scope="module")
def log_marks(api_stack) -> dict[Path, int]:
    """Each service log's size before this module's first request."""
    return {path: path.stat().st_size for path in (api_stack.run_dir / "logs").glob("*.log")}


LOG_ERROR_MARKERS = (
    "Traceback",
    '"level": "error"',
    "Exception calling application",
    "Exception in callback",
)


def new_log_errors(marks: dict[Path, int]) -> list[str]:
    bad = []
    for path, offset in marks.items():
        with open(path, "rb") as log:
            log.seek(offset)
            for line in log.read().decode(errors="replace").splitlines():
                if any(marker in line for marker in LOG_ERROR_MARKERS):
                    bad.append(f"{path.name}: {line[:400]}")
    return bad


def assert_stack_unharmed(api_stack, tiny_llama_dir, marks) -> None:
    wait_until_idle(api_stack)  # pools all-free, no worker holding a request, integrity clean
    dead = [p.name for p in api_stack.processes if not api_stack.alive(p)]
    assert not dead, f"services died: {dead}"
    assert not new_log_errors(marks), "\n".join(new_log_errors(marks)[:20])
    prompt = "Once upon a time, the fuzzer"
    got = generate(api_stack.spec.gateway_address, greedy_request(prompt, 12), timeout=60)
    ids = hf_tokenizer(str(tiny_llama_dir)).encode(prompt)
    assert got.token_ids == hf_generate(tiny_llama_dir, ids, max_new_tokens=12)


def report(capsys, line: str) -> None:
    with capsys.disabled():
        print(f"\n{line}")


# ---------------------------------------------------------------------------------------
# 1. Structured fuzzing

GENERATE_TALLY = Tally()


@settings(max_examples=300, **FUZZ)
@given(request=generate_requests())
def test_fuzzed_generate_requests_end_ok_or_invalid_argument(stub, documented, log_marks, request):
    code, details, messages, _ = call_stream(stub.Generate, request)
    check_generate_outcome(request, code, details, messages, documented, GENERATE_TALLY)


BATCH_TALLY = Tally()
NEIGHBOUR_PROMPT = "The scheduler batches every request"


def neighbours() -> list[generate_pb2.GenerateRequest]:
    """A greedy and a seeded request whose outputs must not depend on their batch."""
    greedy = greedy_request(NEIGHBOUR_PROMPT, 8)
    seeded = generate_pb2.GenerateRequest(text=NEIGHBOUR_PROMPT, max_tokens=8)
    seeded.sampling.temperature, seeded.sampling.top_p, seeded.sampling.seed = 0.9, 0.95, 11
    return [greedy, seeded]


@pytest.fixture(scope="module")
def neighbour_outputs(stub, tiny_llama_dir) -> list[list[int]]:
    """Each neighbour's tokens when it runs alone (greedy: also checked against HF)."""
    outputs = []
    for request in neighbours():
        code, details, messages, _ = call_stream(stub.Generate, request)
        assert code == grpc.StatusCode.OK, details
        outputs.append([t for m in messages for t in m.token_ids])
    prompt_ids = hf_tokenizer(str(tiny_llama_dir)).encode(NEIGHBOUR_PROMPT)
    assert outputs[0] == hf_generate(tiny_llama_dir, prompt_ids, max_new_tokens=8)
    return outputs


@settings(max_examples=25, **FUZZ)
@given(batch=st.lists(generate_requests(), min_size=3, max_size=6))
def test_fuzzed_requests_in_one_batch_leave_their_neighbours_exact(
    stub, documented, neighbour_outputs, batch
):
    """Fuzzed requests sent together (so they share worker steps) with a greedy and a
    seeded neighbour: each ends as it would alone, and the neighbours' tokens are exactly
    their solo tokens, whatever extreme values share their batch."""
    requests = [*neighbours(), *batch]
    barrier = threading.Barrier(len(requests))

    def one(request):
        barrier.wait()
        return call_stream(stub.Generate, request)

    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(one, requests))
    for want, (code, details, messages, _) in zip(neighbour_outputs, results, strict=False):
        assert code == grpc.StatusCode.OK, (code, details)
        assert [t for m in messages for t in m.token_ids] == want, [str(r)[:300] for r in batch]
        BATCH_TALLY.add("neighbour ok")
    for request, (code, details, messages, _) in zip(batch, results[2:], strict=True):
        check_generate_outcome(request, code, details, messages, documented, BATCH_TALLY)


def test_structured_generate_fuzz_left_the_stack_unharmed(
    api_stack, tiny_llama_dir, log_marks, capsys
):
    report(capsys, GENERATE_TALLY.line("Generate (structured)"))
    report(capsys, BATCH_TALLY.line("Generate (structured, concurrent batches)"))
    assert_stack_unharmed(api_stack, tiny_llama_dir, log_marks)


TOKENIZE_TALLY = Tally()


@st.composite
def tokenize_requests(draw) -> generate_pb2.TokenizeRequest:
    r = generate_pb2.TokenizeRequest()
    kind = draw(st.sampled_from(["text", "text", "chat", "none"]))
    if kind == "text":
        r.text = draw(texts)
    elif kind == "chat":
        r.chat.SetInParent()
        r.chat.messages.extend(draw(chats))
        add = draw(st.one_of(st.none(), st.booleans()))
        if add is not None:
            r.chat.add_generation_prompt = add
    add_special = draw(st.one_of(st.none(), st.booleans()))
    if add_special is not None:
        r.add_special_tokens = add_special
    return r


detokenize_requests = st.builds(
    lambda ids, skip: generate_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip),
    weighted(
        (3, st.lists(st.integers(0, VOCAB - 1), max_size=40)),
        (1, st.lists(any_id, max_size=8)),
        (1, st.sampled_from([2**20, 2**20 + 1]).map(lambda k: [5] * k)),
    ),
    st.one_of(st.none(), st.booleans()),
)


@settings(max_examples=120, **FUZZ)
@given(request=tokenize_requests())
def test_fuzzed_tokenize_matches_the_tokenizer_or_is_invalid_argument(
    stub, documented, tiny_llama_dir, request
):
    code, details, reply = call_unary(stub.Tokenize, request)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    which = request.WhichOneof("input")
    if which == "text":
        violation = "text" if utf8_len(request.text) > MAX_TEXT_BYTES else None
    elif which == "chat":
        messages = request.chat.messages
        bad_chat = (
            not 1 <= len(messages) <= 1024
            or any(m.role not in ROLES for m in messages)
            or sum(utf8_len(m.content) for m in messages) > MAX_TEXT_BYTES
        )
        violation = "chat" if bad_chat else None
    else:
        violation = "input"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        check_documented(details, documented)
        field = error_field(details)
        assert field.split(".")[0] == violation, (details, violation)
        TOKENIZE_TALLY.add("invalid", field)
        return
    assert violation is None, f"accepted although {violation} breaks a documented limit"
    assert len(reply.tokens) == len(reply.token_ids) and reply.max_model_len == MAX_LEN
    if which == "text":
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        tok = hf_tokenizer(str(tiny_llama_dir))
        assert list(reply.token_ids) == tok.encode(request.text, add_special_tokens=add)
    else:
        assert all(0 <= t < VOCAB for t in reply.token_ids)
    TOKENIZE_TALLY.add("ok")


@settings(max_examples=100, **FUZZ)
@given(request=detokenize_requests)
def test_fuzzed_detokenize_matches_the_tokenizer_or_is_invalid_argument(
    stub, documented, tiny_llama_dir, request
):
    code, details, reply = call_unary(stub.Detokenize, request)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    ids = list(request.token_ids)
    valid = len(ids) <= 2**20 and all(0 <= t < VOCAB for t in ids)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert not valid, details
        check_documented(details, documented)
        TOKENIZE_TALLY.add("invalid", error_field(details))
        return
    assert valid
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    if len(ids) < 1000:
        want = hf_tokenizer(str(tiny_llama_dir)).decode(ids, skip_special_tokens=skip)
        assert reply.text == want
    TOKENIZE_TALLY.add("ok")


def test_tokenize_fuzz_left_the_stack_unharmed(api_stack, tiny_llama_dir, log_marks, capsys):
    report(capsys, TOKENIZE_TALLY.line("Tokenize/Detokenize (structured)"))
    assert_stack_unharmed(api_stack, tiny_llama_dir, log_marks)


# ---------------------------------------------------------------------------------------
# 2. Wire-level fuzzing

WIRE_TALLY = Tally()
# max_tokens = 2 (field 4, varint): appended to a payload that parses, it keeps the
# generation short whatever the rest holds (the last value of a scalar field wins).
SHORT_GENERATION = b"\x20\x02"


@st.composite
def wire_payloads(draw, base_requests: st.SearchStrategy) -> bytes:
    kind = draw(st.sampled_from(["random", "truncate", "flip", "insert", "delete", "concat"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    base = draw(base_requests).SerializeToString()
    at = draw(st.integers(0, len(base)))
    if kind == "truncate":
        return base[:at]
    if kind == "flip":
        if not base:
            return base
        at = min(at, len(base) - 1)
        return base[:at] + bytes([draw(st.integers(0, 255))]) + base[at + 1 :]
    if kind == "insert":
        return base[:at] + draw(st.binary(min_size=1, max_size=12)) + base[at:]
    if kind == "delete":
        return base[:at] + base[at + draw(st.integers(1, 8)) :]
    return base + draw(base_requests).SerializeToString()  # concatenation = merge


def parses(message_type, data: bytes):
    try:
        return message_type.FromString(data)
    except Exception:
        return None


# Small valid requests with every field set, to mutate.
@st.composite
def small_generate_requests(draw) -> generate_pb2.GenerateRequest:
    r = generate_pb2.GenerateRequest(max_tokens=draw(st.integers(1, 3)))
    kind = draw(st.sampled_from(["text", "token_ids", "chat"]))
    if kind == "text":
        r.text = draw(st.text(any_char, min_size=1, max_size=12))
    elif kind == "token_ids":
        r.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)))
    else:
        r.chat.messages.add(role=draw(st.sampled_from(ROLES)), content=draw(st.text(max_size=8)))
        r.chat.add_generation_prompt = draw(st.booleans())
    r.sampling.CopyFrom(
        generate_pb2.SamplingParams(
            temperature=0.7, top_p=0.9, top_k=20, min_p=0.01, repetition_penalty=1.1,
            presence_penalty=0.1, frequency_penalty=0.1, logit_bias={5: 1.5, 9: -2.0},
            seed=draw(st.integers(*UINT64)),
        )
    )  # fmt: skip
    r.stopping.CopyFrom(
        generate_pb2.StoppingParams(
            stop=["xyz"], include_stop_str_in_output=True, stop_token_ids=[3, 4],
            ignore_eos=True, min_tokens=1, skip_special_tokens=False,
        )
    )  # fmt: skip
    r.n, r.logprobs, r.prompt_logprobs = draw(st.integers(1, 2)), 2, 1
    r.cache_salt = "tenant-ä"
    return r


@settings(max_examples=200, **FUZZ)
@given(payload=wire_payloads(small_generate_requests()))
def test_mutated_generate_bytes_end_ok_or_invalid_argument(channel, documented, payload):
    request = parses(generate_pb2.GenerateRequest, payload)
    if request is not None and (not request.HasField("max_tokens") or request.max_tokens > 8):
        payload += SHORT_GENERATION
        request = generate_pb2.GenerateRequest.FromString(payload)
    raw = channel.unary_stream(
        "/tandem.v1.GenerateService/Generate",
        request_serializer=lambda b: b,
        response_deserializer=generate_pb2.GenerateResponse.FromString,
    )
    code, details, messages, _ = call_stream(raw, payload)
    if request is None:  # does not parse here, so must not parse on the server either
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, payload)
        assert MALFORMED in details and "tandem.v1.GenerateRequest" in details, details
        WIRE_TALLY.add("malformed")
        return
    assert MALFORMED not in details, (details, payload)
    check_generate_outcome(request, code, details, messages, documented, WIRE_TALLY)


UNARY_METHODS = {
    "Tokenize": (generate_pb2.TokenizeRequest, generate_pb2.TokenizeResponse),
    "Detokenize": (generate_pb2.DetokenizeRequest, generate_pb2.DetokenizeResponse),
}
small_unary_requests = st.one_of(
    st.builds(
        generate_pb2.TokenizeRequest, text=st.text(max_size=10), add_special_tokens=st.booleans()
    ),
    st.builds(
        generate_pb2.DetokenizeRequest,
        token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=6),
        skip_special_tokens=st.booleans(),
    ),
)


@settings(max_examples=100, **FUZZ)
@given(method=st.sampled_from(sorted(UNARY_METHODS)), payload=wire_payloads(small_unary_requests))
def test_mutated_tokenize_and_detokenize_bytes_end_ok_or_invalid_argument(
    channel, documented, method, payload
):
    request_type, response_type = UNARY_METHODS[method]
    raw = channel.unary_unary(
        f"/tandem.v1.GenerateService/{method}",
        request_serializer=lambda b: b,
        response_deserializer=response_type.FromString,
    )
    code, details, _ = call_unary(raw, payload)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
    parsed = parses(request_type, payload)
    if parsed is None:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and MALFORMED in details, details
        assert f"tandem.v1.{method}Request" in details, details
        WIRE_TALLY.add("malformed")
    elif code == grpc.StatusCode.INVALID_ARGUMENT:
        check_documented(details, documented)
        WIRE_TALLY.add("invalid", error_field(details))
    else:
        WIRE_TALLY.add("ok")


def test_wire_fuzz_left_the_stack_unharmed(api_stack, tiny_llama_dir, log_marks, capsys):
    report(capsys, WIRE_TALLY.line("wire bytes (Generate, Tokenize, Detokenize)"))
    assert_stack_unharmed(api_stack, tiny_llama_dir, log_marks)


# ---------------------------------------------------------------------------------------
# 3. Oversize messages


# The public gateway's request cap (--max-request-bytes; internal hops allow more).
MAX_MESSAGE_BYTES = parse_size(GatewayConfig.__dataclass_fields__["max_request_bytes"].default)


def text_payload(size: int) -> bytes:
    """A GenerateRequest / TokenizeRequest (field 1: text) of exactly `size` bytes of text."""
    length, varint = size, bytearray()
    while True:
        byte, length = length & 0x7F, length >> 7
        varint.append(byte | (0x80 if length else 0))
        if not length:
            break
    return b"\x0a" + bytes(varint) + b"x" * size


def test_messages_over_the_receive_limit_are_resource_exhausted(
    api_stack, channel, tiny_llama_dir, log_marks, capsys
):
    generate_raw = channel.unary_stream(
        "/tandem.v1.GenerateService/Generate",
        request_serializer=lambda b: b,
        response_deserializer=generate_pb2.GenerateResponse.FromString,
    )
    tokenize_raw = channel.unary_unary(
        "/tandem.v1.GenerateService/Tokenize",
        request_serializer=lambda b: b,
        response_deserializer=generate_pb2.TokenizeResponse.FromString,
    )
    # Just under the limit: it arrives, and fails validation (the text is over 4 MiB).
    under = text_payload(MAX_MESSAGE_BYTES - 16)
    assert len(under) < MAX_MESSAGE_BYTES
    code, details, _, _ = call_stream(generate_raw, under)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "prompt.text must be at most 4194304 bytes" in details
    # Over it: refused by grpc on receipt (the server's message, not the client's).
    over = text_payload(MAX_MESSAGE_BYTES + 1024)
    code, details, _, elapsed = call_stream(generate_raw, over)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert "Received message larger than max" in details, details
    code, details, _ = call_unary(tokenize_raw, over)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details, details
    report(capsys, f"fuzz oversize: 3 requests of ~16 MiB (1 invalid, 2 exhausted, {elapsed:.1f}s)")
    assert_stack_unharmed(api_stack, tiny_llama_dir, log_marks)


# A prompt of this many bytes takes the tokenizer a second or more.
LARGE_PROMPT = "hello world " * 120_000


def worst_latency_during(stub, request) -> tuple[float, grpc.StatusCode]:
    """The slowest GetModelInfo answer while `request` (a large prompt) is being handled."""
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(call_stream(stub.Generate, request)))
    worker.start()
    worst = 0.0
    while worker.is_alive():
        start = time.monotonic()
        stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=DEADLINE_S)
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.02)
    worker.join()
    return worst, outcome[0][0]


def test_a_large_text_prompt_does_not_stall_the_gateway(stub):
    request = generate_pb2.GenerateRequest(text=LARGE_PROMPT, max_tokens=1)
    worst, code = worst_latency_during(stub, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # far past the context length
    assert worst < 0.75, f"GetModelInfo took {worst:.2f}s while a large prompt was tokenized"


def test_a_large_chat_prompt_does_not_stall_the_gateway(stub):
    request = generate_pb2.GenerateRequest(max_tokens=1)
    request.chat.messages.add(role="user", content=LARGE_PROMPT)
    worst, code = worst_latency_during(stub, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # far past the context length
    assert worst < 0.75, f"GetModelInfo took {worst:.2f}s while a large chat was tokenized"


# ---------------------------------------------------------------------------------------
# 4. The OpenAI HTTP front

HTTP_TALLY = Tally()
MODEL = "tiny-llama"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def http_address(api_stack, tmp_path_factory):
    """`python -m services.openai_api` in front of the shared stack's gateway."""
    log_path = tmp_path_factory.mktemp("fuzz-http") / "http.log"
    with http_front(api_stack.spec.gateway_address, log_path) as (address, process):
        yield address, process, log_path


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
junk_json = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
json_numbers = st.one_of(
    st.sampled_from([0, 1, -1, 0.5, 2, 100, 1e-300, 1e300, 2**31, -(2**63), 2**64]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(-(2**65), 2**65),
)
json_small_ints = st.one_of(st.integers(1, 4), st.sampled_from([0, -1, 2**31, 2**63, 10**6]))
http_prompts = st.one_of(
    st.text(any_char, max_size=30),
    st.sampled_from(["", "</s>", "\x00", "🚀" * 10]),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
    st.lists(any_id, max_size=5),
    st.lists(st.text(max_size=10), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(-2, VOCAB + 2), max_size=5), min_size=1, max_size=3),
    junk_json,
)
text_parts = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2
)
odd_parts = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text", 3])}), max_size=2
)
http_message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from([*ROLES, "developer", "robot", ""]), junk_json)},
    optional={
        "content": st.one_of(st.text(any_char, max_size=30), text_parts, odd_parts, junk_json),
        "name": st.text(max_size=4),
    },
)
http_messages = st.one_of(st.lists(http_message, max_size=4), junk_json)
COMMON_FIELDS = {
    "model": st.one_of(st.just(MODEL), st.none(), st.text(max_size=8), junk_json),
    "temperature": json_numbers,
    "top_p": json_numbers,
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, 50, -2]), junk_json),
    "min_p": json_numbers,
    "repetition_penalty": json_numbers,
    "presence_penalty": json_numbers,
    "frequency_penalty": json_numbers,
    "seed": st.one_of(st.integers(-1, 2**64), junk_json),
    "logit_bias": st.one_of(
        st.dictionaries(st.integers(-5, VOCAB + 5).map(str), json_numbers, max_size=3),
        st.dictionaries(st.text(max_size=4), junk_json, max_size=2),
        junk_json,
    ),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), junk_json),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, VOCAB + 2), max_size=3), junk_json),
    "ignore_eos": st.one_of(st.booleans(), junk_json),
    "include_stop_str_in_output": st.booleans(),
    "min_tokens": st.one_of(st.integers(-1, 6), junk_json),
    "skip_special_tokens": st.one_of(st.booleans(), junk_json),
    "n": st.one_of(st.sampled_from([1, 2, 0, 17, -1]), junk_json),
    "best_of": st.sampled_from([1, 2, 3]),
    "use_beam_search": st.booleans(),
    "cache_salt": st.one_of(st.text(max_size=8), st.just("s" * 300), junk_json),
    "user": st.one_of(st.text(max_size=4), junk_json),
    "prompt_logprobs": st.one_of(st.sampled_from([0, 1, 21, -1]), junk_json),
    "stream": st.one_of(st.booleans(), junk_json),
    "stream_options": st.one_of(
        st.fixed_dictionaries({}, optional={"include_usage": st.booleans(), "x": st.just(1)}),
        junk_json,
    ),
    "unknown_field": junk_json,
}
COMPLETION_FIELDS = {
    **COMMON_FIELDS,
    "max_tokens": st.one_of(json_small_ints, st.none(), junk_json),
    "logprobs": st.one_of(st.sampled_from([0, 2, 5, 21, -1]), junk_json),
    "echo": st.one_of(st.booleans(), junk_json),
    "suffix": st.text(max_size=3),
}
CHAT_FIELDS = {
    **COMMON_FIELDS,
    "max_tokens": st.one_of(json_small_ints, junk_json),
    "max_completion_tokens": st.one_of(json_small_ints, junk_json),
    "logprobs": st.one_of(st.booleans(), junk_json),
    "top_logprobs": st.one_of(st.sampled_from([0, 2, 20, 21, -1]), junk_json),
    "add_generation_prompt": st.booleans(),
    "tools": st.one_of(st.just([]), st.just([{"type": "function"}]), junk_json),
    "tool_choice": st.sampled_from(["none", "auto", None]),
    "response_format": st.one_of(
        st.just({"type": "text"}), st.just({"type": "json_object"}), junk_json
    ),
}


def subset_of(fields: dict) -> st.SearchStrategy:
    """A few of the fields (each body sets about three)."""
    keys = st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)
    return keys.flatmap(lambda ks: st.fixed_dictionaries({k: fields[k] for k in ks}))


def keep_short(path: str, body):
    """Cap generation lengths (the point is the parsing, not long generations)."""
    if not isinstance(body, dict):
        return body
    keys = ("max_tokens",) if path == "/v1/completions" else ("max_tokens", "max_completion_tokens")
    for key in keys:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 4 < value <= MAX_LEN:
            body[key] = 4
    if path == "/v1/completions" and "max_tokens" in body and body["max_tokens"] is None:
        body["max_tokens"] = 4  # null: until the context ends
    if path != "/v1/completions" and all(body.get(k) is None for k in keys):
        body["max_completion_tokens"] = 4  # unset: until the context ends
    return body


@st.composite
def http_bodies(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    shape = draw(st.sampled_from(["fields"] * 6 + ["junk", "bytes", "broken", "deep"]))
    if shape == "deep":  # nesting past the 128-level limit, somewhere in the body (issue 19)
        depth = draw(st.integers(129, 200_000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        inner = opener * depth + "1" + closer * depth
        where = draw(st.sampled_from(["body", "prompt", "messages", "unknown field"]))
        key = {"body": None, "unknown field": "x"}.get(where, where)
        return path, (inner if key is None else json.dumps({key: 0})[:-2] + inner + "}").encode()
    if shape == "junk":
        return path, json.dumps(keep_short(path, draw(junk_json))).encode()
    if shape == "bytes":
        return path, draw(st.binary(max_size=64))
    if path == "/v1/completions":
        body = {"prompt": draw(http_prompts), **draw(subset_of(COMPLETION_FIELDS))}
    else:
        body = {"messages": draw(http_messages), **draw(subset_of(CHAT_FIELDS))}
    if draw(st.booleans()):  # a well-formed prompt, so the rest gets to the gateway
        body["prompt" if path == "/v1/completions" else "messages"] = (
            "Hello" if path == "/v1/completions" else [{"role": "user", "content": "Hi"}]
        )
    data = json.dumps(keep_short(path, body)).encode()
    if shape == "broken":
        cut = draw(st.integers(0, len(data)))
        data = data[:cut] + draw(st.sampled_from([b"", b"NaN", b"}", b"\xff", b"Infinity"]))
    return path, data


def post(address: str, path: str, body: bytes) -> tuple[int, str, bytes]:
    request = urllib.request.Request(
        f"http://{address}{path}", data=body, method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as reply:
            return reply.status, reply.headers.get("content-type", ""), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("content-type", ""), exc.read()


def check_http(status: int, content_type: str, data: bytes, tally: Tally) -> None:
    assert status == 200 or 400 <= status < 500, (status, data[:500])
    if status != 200:
        error = json.loads(data)["error"]
        assert set(error) == ERROR_KEYS and isinstance(error["message"], str), error
        assert error["message"] and isinstance(error["type"], str), error
        tally.add(f"http {status}", error.get("param") or error.get("code"))
        return
    if content_type.startswith("text/event-stream"):
        events = [line[6:] for line in data.decode().split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert json.loads(data)["choices"], data[:500]
    tally.add("http 200")


@settings(max_examples=160, **FUZZ)
@given(case=http_bodies())
def test_fuzzed_http_bodies_get_200_or_an_openai_shaped_4xx(http_address, case):
    address, process, log_path = http_address
    path, body = case
    status, content_type, data = post(address, path, body)
    check_http(status, content_type, data, HTTP_TALLY)


def test_http_fuzz_left_the_stack_unharmed(
    http_address, api_stack, tiny_llama_dir, log_marks, capsys
):
    address, process, log_path = http_address
    # A body over the 8 MiB limit is refused whole, without reaching the gateway.
    status, _, data = post(address, "/v1/completions", b'{"prompt": "' + b"x" * (9 << 20) + b'"}')
    assert status == 413 and json.loads(data)["error"]["type"] == "invalid_request_error"
    HTTP_TALLY.add(f"http {status}")
    report(capsys, HTTP_TALLY.line("HTTP /v1/completions + /v1/chat/completions"))
    assert process.poll() is None, "the HTTP front exited"
    assert not new_log_errors({log_path: 0}), "\n".join(new_log_errors({log_path: 0})[:20])
    assert_stack_unharmed(api_stack, tiny_llama_dir, log_marks)
