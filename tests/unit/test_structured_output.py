"""Structured output's worker side: constraints compiled by
xgrammar for the real (tiny BPE) tokenizer; random logits, which alone would give
garbage, masked row by row in a batch mixing constrained and free requests; every output
that the grammar says is complete parses and validates (JSON schema), full-matches
(regex) or is one of the choices; a matcher rebuilt from the tokens so far (a request
moving to another worker or recomputed) masks exactly as the original."""

from __future__ import annotations

import json
import re

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from common.grammar_cache import (  # noqa: E402
    Constraint,
    ConstraintError,
    GrammarCache,
)
from services.worker.structured.matchers import RequestMatchers  # noqa: E402
from tests.hf_reference import hf_tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "size": {"enum": ["S", "M", "L"]},
    },
    "required": ["name", "ok", "size"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe not"]
SHORT_REGEX = r"[0-9]{2}-[a-z]{1,2}"


@pytest.fixture(scope="module")
def cache(tiny_llama_dir):
    """JSON held to single spaces: random logits would otherwise spend their 200 tokens
    on whitespace, which the default (vLLM's) allows anywhere between JSON tokens."""
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    return GrammarCache(tokenizer, vocab_size=len(tokenizer), any_whitespace=False), tokenizer


def _accepts(grammars: GrammarCache, constraint: Constraint, text: str, tokenizer) -> bool:
    """Whether the grammar takes `text` (tokenized) and may stop right after it."""
    matchers = RequestMatchers(grammars.vocab_size)
    matchers.start("r", grammars.compile(constraint))
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matchers.accept("r", token):
            return False
    logits = torch.zeros(1, grammars.vocab_size)
    matchers.mask(logits, [(0, "r")])
    eos = tokenizer.eos_token_id
    return bool(torch.isfinite(logits[0, eos]))


def test_json_takes_any_whitespace_by_default_as_vllm_and_single_spaces_when_disabled(
    tiny_llama_dir,
):
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    default = GrammarCache(tokenizer, vocab_size=len(tokenizer))
    compact = GrammarCache(tokenizer, vocab_size=len(tokenizer), any_whitespace=False)
    schema = Constraint("json_schema", json.dumps(SCHEMA))
    value = {"name": "Ada", "ok": True, "size": "M"}
    pretty = json.dumps(value, indent=2)  # newlines and indents
    spaced = json.dumps(value)  # one space after each , and :
    jsonschema.validate(json.loads(pretty), SCHEMA)
    assert _accepts(default, schema, pretty, tokenizer)
    assert _accepts(default, schema, spaced, tokenizer)
    assert not _accepts(compact, schema, pretty, tokenizer)
    assert _accepts(compact, schema, spaced, tokenizer)


def constraints():
    return {
        "schema": Constraint("json_schema", json.dumps(SCHEMA)),
        "regex": Constraint("regex", REGEX),
        "choice": Constraint.choice(CHOICES),
    }


def check(kind: str, text: str) -> None:
    if kind == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_masked_random_logits_always_produce_valid_outputs(cache, temperature):
    grammars, tokenizer = cache
    compiled = {kind: grammars.compile(c) for kind, c in constraints().items()}
    vocab = grammars.vocab_size
    gen = torch.Generator().manual_seed(int(temperature * 10) + 1)
    for trial in range(4):
        matchers = RequestMatchers(vocab)
        kinds = [*compiled, None]  # one free request rides in the same batch
        out = {i: [] for i in range(len(kinds))}
        for i, kind in enumerate(kinds):
            if kind is not None:
                matchers.start(f"r{i}", compiled[kind])
        done = set()
        for _ in range(200):
            live = [i for i in range(len(kinds)) if kinds[i] is not None and i not in done]
            if not live:
                break
            logits = torch.randn(len(kinds), vocab, generator=gen) * 4
            free_before = logits[len(kinds) - 1].clone()
            matchers.mask(logits, [(i, f"r{i}") for i in live])
            assert torch.equal(logits[len(kinds) - 1], free_before)  # unconstrained row
            for i in live:
                if temperature == 0:
                    token = int(logits[i].argmax())
                else:
                    token = int(torch.multinomial(torch.softmax(logits[i], -1), 1, generator=gen))
                assert matchers.accept(f"r{i}", token)
                if matchers.terminated(f"r{i}"):  # it sampled the stop token
                    done.add(i)
                else:
                    out[i].append(token)
        for i, kind in enumerate(kinds[:-1]):
            assert i in done, (kind, trial, tokenizer.decode(out[i]))
            check(kind, tokenizer.decode(out[i]))


def test_a_rebuilt_matcher_masks_like_the_original(cache):
    grammars, _ = cache
    compiled = grammars.compile(constraints()["schema"])
    vocab = grammars.vocab_size
    original = RequestMatchers(vocab)
    original.start("a", compiled)
    gen = torch.Generator().manual_seed(7)
    tokens = []
    for _ in range(12):
        logits = torch.randn(1, vocab, generator=gen)
        original.mask(logits, [(0, "a")])
        token = int(logits[0].argmax())
        original.accept("a", token)
        tokens.append(token)
    moved = RequestMatchers(vocab)
    moved.start("a", compiled, tokens)  # e.g. the decode worker taking the request over
    for _ in range(5):
        logits = torch.randn(1, vocab, generator=gen)
        a, b = logits.clone(), logits.clone()
        original.mask(a, [(0, "a")])
        moved.mask(b, [(0, "a")])
        assert torch.equal(a, b)
        token = int(a[0].argmax())
        assert original.accept("a", token) and moved.accept("a", token)
    with pytest.raises(ValueError, match="does not fit"):
        RequestMatchers(vocab).start("b", compiled, [tokens[1]])  # JSON cannot start so


def test_json_object_means_an_object(cache):
    """Unbounded, so random logits need not close it: checked on given texts instead."""
    grammars, tokenizer = cache
    compiled = grammars.compile(Constraint("json_object"))
    for text, complete in [('{"a": [1, 2], "b": null}', True), ("[1, 2]", False)]:
        matchers = RequestMatchers(grammars.vocab_size)
        try:
            matchers.start("r", compiled, tokenizer.encode(text, add_special_tokens=False))
        except ValueError:
            assert not complete, text
            continue
        assert complete and matchers.completed("r") and not matchers.terminated("r"), text


def test_bad_constraints_are_refused_with_the_reason(cache):
    grammars, _ = cache
    with pytest.raises(ConstraintError, match="json_schema"):
        grammars.compile(Constraint("json_schema", "{not json"))
    with pytest.raises(ConstraintError, match="regex"):
        grammars.compile(Constraint("regex", "[unclosed"))
    with pytest.raises(ConstraintError, match="grammar"):
        grammars.compile(Constraint("grammar", "root ::= undefined_rule"))
    with pytest.raises(ConstraintError, match="choice"):
        Constraint.choice([])
    with pytest.raises(ConstraintError, match="kind"):
        Constraint("xml", "<a/>")


def test_the_runner_masks_constrained_requests_in_a_mixed_batch(tiny_llama_dir):
    """Through the real model and ModelRunner: a regex-constrained request and a free one
    decode in the same steps; the constrained output full-matches and ends with a stop
    token, the free one equals its unconstrained greedy run."""
    from common.sampling import SamplingParams
    from common.step_plan import CachedRequestData
    from services.worker.models.weight_loader import load_model
    from services.worker.structured.state import StructuredOutputs
    from tests.unit.test_runner_logprobs import Driver

    model, config = load_model(tiny_llama_dir, dtype=torch.float32)
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    greedy = SamplingParams(temperature=0.0)
    prompt = tokenizer.encode("Once upon a time")
    stops = {tokenizer.eos_token_id}

    def run(constrained: bool) -> dict[str, list[int]]:
        driver = Driver(model, config)
        driver.runner.structured = StructuredOutputs(str(tiny_llama_dir), config.vocab_size)
        new = [driver.new("free", prompt, len(prompt), greedy)]
        if constrained:
            data = driver.new("re", prompt, len(prompt), greedy)
            short = Constraint("regex", SHORT_REGEX)  # short: the driver's pool is small
            new.append(type(data)(**{**data.__dict__, "structured": short}))
        out = {d.request_id: [] for d in new}
        output = driver.step(new=new)
        for _ in range(8):
            for rid, token in output.sampled.items():
                out[rid].append(token)
            running = [rid for rid in out if not (rid == "re" and out[rid][-1] in stops)]
            output = driver.step(cached=[CachedRequestData(rid, [], 1) for rid in running])
        return out

    plain, mixed = run(False), run(True)
    assert mixed["free"] == plain["free"]
    constrained = mixed["re"]
    assert constrained[-1] in stops, tokenizer.decode(constrained)
    text = tokenizer.decode(constrained[:-1])
    assert re.fullmatch(SHORT_REGEX, text), tokenizer.decode(constrained)


def test_a_forgotten_request_restarts_from_its_tokens(tiny_llama_dir):
    """A request dropped from a worker's batch (finished, preempted) and sent again (a
    recompute) gets a new matcher that replays the tokens it has generated."""
    from dataclasses import dataclass, field

    from services.worker.structured.state import StructuredOutputs

    @dataclass
    class Request:
        request_id: str
        token_ids: list[int]
        num_prompt_tokens: int
        structured: Constraint | None = field(default_factory=lambda: Constraint("regex", REGEX))

    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    vocab = len(tokenizer)
    state = StructuredOutputs(str(tiny_llama_dir), vocab)
    prompt = tokenizer.encode("Hi")
    request = Request("r", list(prompt), len(prompt))
    digits = tokenizer.encode("12", add_special_tokens=False)
    for token in digits:  # the request generates "12"
        state.mask(torch.zeros(1, vocab), [request])
        state.accept([request], [token])
        request.token_ids.append(token)
    continued = torch.zeros(1, vocab)
    state.mask(continued, [request])
    state.forget(["r"])
    restarted = torch.zeros(1, vocab)
    state.mask(restarted, [request])  # replays "12"
    assert torch.equal(continued, restarted)
    fresh = torch.zeros(1, vocab)
    state.reset()
    state.mask(fresh, [Request("r", list(prompt), len(prompt))])  # nothing generated yet
    assert not torch.equal(fresh, restarted)


def test_constrained_requests_get_no_speculative_drafts(tiny_llama_dir):
    """With speculative decoding on, a proposer that proposes the request's own constrained
    continuation (every draft would be accepted) is not asked for a constrained request,
    whose output equals its plain constrained run; drafts are verified without the mask."""
    from common.sampling import SamplingParams
    from common.step_plan import CachedRequestData, NewRequestData
    from services.worker.models.weight_loader import load_model
    from services.worker.structured.state import StructuredOutputs
    from tests.unit.test_spec_decode_runner import Driver, Oracle

    model = load_model(tiny_llama_dir, dtype=torch.float32)
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    prompt = tokenizer.encode("Once upon a time")
    greedy = SamplingParams(temperature=0.0)
    stops = {tokenizer.eos_token_id}

    def constrained_run(proposer, lookahead: int) -> list[int]:
        driver = Driver(model, proposer=proposer)
        driver.runner.structured = StructuredOutputs(str(tiny_llama_dir), model[1].vocab_size)
        blocks = driver.blocks(len(prompt) + 40)
        short = Constraint("regex", SHORT_REGEX)
        data = NewRequestData("re", prompt, blocks, 0, len(prompt), greedy, structured=short)
        out = [driver.step(new=[data]).sampled["re"]]
        while out[-1] not in stops and len(out) < 24:
            output = driver.step(cached=[CachedRequestData("re", [], 1, (), lookahead)])
            assert output.accepted_tokens == {}, "a constrained request was given drafts"
            out.append(output.sampled["re"])
        return out

    plain = constrained_run(None, 0)
    assert plain[-1] in stops
    assert re.fullmatch(SHORT_REGEX, tokenizer.decode(plain[:-1])), tokenizer.decode(plain)
    assert constrained_run(Oracle([prompt + plain]), 3) == plain
    # The same kind of proposer does speculate for a free request.
    (free,), _ = Driver(model).generate([prompt], 12, greedy)
    _, accepted = Driver(model, proposer=Oracle([prompt + free])).generate(
        [prompt], 12, greedy, k=3
    )
    assert accepted > 0
