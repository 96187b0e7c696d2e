"""What the API fuzz sends and what docs/api.md says of it: hypothesis strategies for
`GenerateRequest`s (every field at its limits and beyond) and the oracle, written from the
documented limits independently of the gateway's code, that says which requests must fail
and which fields an error may name."""

from __future__ import annotations

import math
import re

import grpc
from hypothesis import HealthCheck
from hypothesis import strategies as st

from common.pb.tandem.v1 import generate_pb2

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


def tool_turns_answer_calls(messages) -> bool:
    """docs/api.md's tool table: each tool turn answers a call an earlier turn made."""
    called: set[str] = set()
    for message in messages:
        called.update(call.id for call in message.tool_calls)
        if message.role == "tool" and message.tool_call_id not in called:
            return False
    return True


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
            or not tool_turns_answer_calls(messages)
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
