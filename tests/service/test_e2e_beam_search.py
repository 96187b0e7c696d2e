"""Beam search through the real services, token for token equal to Hugging Face's
`generate(num_beams=k, do_sample=False)` in fp32 (same length penalty, early stopping and
EOS handling) for k = 2, 4, 8 on two architectures: several beam requests at once with free
greedy requests (which stay equal to HF greedy), through the prefill -> decode split and on
one `both` worker; every KV block back to free after. EOS cases use a stop token id the
model likes (stop token ids are the search's extra EOS ids, as HF's eos_token_id list).
Plus the refusals: INVALID_ARGUMENT naming the field for what beam search does not take."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from tests.hf_reference import hf_beam_search, hf_greedy, hf_model
from tests.service.test_api_validation import documented_messages
from tests.stack_client import (
    generate,
    greedy_request,
    held_together,
    pool_stats,
    start_stack,
    wait_until_idle,
)

PROMPTS = ([5, 17, 300, 42], [9, 250, 3, 77, 101, 64, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21])
MAX_NEW = 10
EARLY = {
    False: generate_pb2.BEAM_EARLY_STOPPING_FALSE,
    True: generate_pb2.BEAM_EARLY_STOPPING_TRUE,
    "never": generate_pb2.BEAM_EARLY_STOPPING_NEVER,
}
# (beam_width, length_penalty, early_stopping, n, prompt index, extra EOS: a liked token)
CASES = [
    (2, 1.0, False, 1, 0, False),
    (4, 2.0, True, 2, 1, False),
    (8, 1.0, "never", 3, 0, False),
    (8, -0.5, False, 8, 1, False),
    (4, 1.0, False, 4, 0, True),
    (2, 0.0, "never", 2, 1, True),
]


def beam_request(prompt, k, lp, es, n, stop_ids=()) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(max_tokens=MAX_NEW, n=n)
    request.token_ids.ids.extend(prompt)
    request.beam_search.beam_width = k
    request.beam_search.length_penalty = lp
    request.beam_search.early_stopping = EARLY[es]
    request.stopping.stop_token_ids.extend(stop_ids)
    return request


def run_beam(address: str, request) -> dict[int, dict]:
    """Each returned hypothesis (by index): its tokens, finish reason and score."""
    out: dict[int, dict] = {}
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for message in stub.Generate(request, timeout=120):
            hyp = out.setdefault(
                message.index, {"tokens": [], "text": "", "reason": None, "score": None}
            )
            hyp["tokens"].extend(message.token_ids)
            hyp["text"] += message.text
            if message.finish_reason:
                hyp["reason"] = message.finish_reason
            if message.HasField("beam_score"):
                hyp["score"] = message.beam_score
    return out


def liked_token(folder, prompt) -> int:
    """The model's second greedy token: as an extra EOS, hypotheses end early."""
    return hf_greedy(folder, prompt, 2)[1]


def expected(folder, case):
    k, lp, es, n, p, extra = case
    prompt = PROMPTS[p]
    eos = [hf_model(str(folder)).generation_config.eos_token_id]
    if extra:
        eos = sorted({*eos, liked_token(folder, prompt)})
    hyps = hf_beam_search(
        folder,
        prompt,
        num_beams=k,
        max_new_tokens=MAX_NEW,
        eos_token_ids=eos,
        num_return_sequences=n,
        length_penalty=lp,
        early_stopping=es,
    )
    return prompt, eos, hyps


def check_all(address: str, folder) -> None:
    """Every case at once with two free greedy requests; each equal to HF."""
    refs = [expected(folder, case) for case in CASES]
    free_prompt = PROMPTS[1]
    with ThreadPoolExecutor(len(CASES) + 2) as pool:
        free = [pool.submit(generate, address, greedy_request(free_prompt, 12)) for _ in range(2)]
        futures = [
            pool.submit(run_beam, address, beam_request(prompt, *case[:4], stop_ids=eos))
            for case, (prompt, eos, _) in zip(CASES, refs, strict=True)
        ]
        results = [f.result() for f in futures]
        free_results = [f.result() for f in free]
    for case, (_, eos, hyps), got in zip(CASES, refs, results, strict=True):
        assert sorted(got) == list(range(case[3])), case
        assert [got[i]["tokens"] for i in range(case[3])] == [h[0] for h in hyps], case
        for i, (tokens, score) in enumerate(hyps):
            reason = (
                generate_pb2.FINISH_REASON_STOP
                if tokens[-1] in eos
                else generate_pb2.FINISH_REASON_LENGTH
            )
            assert got[i]["reason"] == reason, (case, i)
            assert got[i]["score"] == pytest.approx(score, abs=1e-4), (case, i)
    assert sum(h[0][-1] in eos and len(h[0]) < MAX_NEW for _, eos, hs in refs for h in hs)
    greedy = hf_greedy(folder, free_prompt, 12)
    assert all(r.token_ids == greedy for r in free_results)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch(request, tmp_path_factory):
    """(checkpoint, its stacks by topology, tmp): the split stack on llama is the session's
    `api_stack` (the same shape: default prefill + decode worker with the HTTP front)."""
    folder = request.getfixturevalue(f"tiny_{request.param}_dir")
    shared = {"split": request.getfixturevalue("api_stack")} if request.param == "llama" else {}
    stacks = dict(shared)
    yield folder, stacks, tmp_path_factory
    for topology, stack in stacks.items():
        if topology not in shared:
            stack.stop()


def stack_for(arch, topology: str):
    folder, stacks, tmp = arch
    if topology not in stacks:
        kwargs = {"prefill": 0, "decode": 0, "both": 1} if topology == "both" else {"http": True}
        stacks[topology] = start_stack(folder, tmp.mktemp(f"beam-{topology}"), **kwargs)
    return stacks[topology]


@pytest.mark.parametrize("topology", ["split", "both"])
def test_beam_search_equals_hf_with_concurrency(arch, topology):
    stack = stack_for(arch, topology)
    check_all(stack.spec.gateway_address, arch[0])
    stats = wait_until_idle(stack)
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)


def test_beam_search_max_tokens_one_and_abort(arch):
    """max_tokens=1 ends at the first step (no beam forks); a cancelled search frees all."""
    folder = arch[0]
    stack = stack_for(arch, "split")
    address = stack.spec.gateway_address
    prompt = PROMPTS[0]
    eos = [hf_model(str(folder)).generation_config.eos_token_id]
    request = beam_request(prompt, 4, 1.0, False, 2)
    request.max_tokens = 1
    got = run_beam(address, request)
    ref = hf_beam_search(
        folder, prompt, num_beams=4, max_new_tokens=1, eos_token_ids=eos, num_return_sequences=2
    )
    assert [got[i]["tokens"] for i in range(2)] == [h[0] for h in ref]
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        long = beam_request(prompt, 8, 1.0, "never", 1)
        long.max_tokens = 200  # far longer than the deadline allows
        with pytest.raises(grpc.RpcError) as cut:
            for _ in stub.Generate(long, timeout=0.3):
                pass
        assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = wait_until_idle(stack)
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)


def refused(**changes):
    request = beam_request(PROMPTS[0], 4, 1.0, False, 1)
    for path, value in changes.items():
        *parents, name = path.split("__")
        target = request
        for parent in parents:
            target = getattr(target, parent)
        if isinstance(value, list):
            getattr(target, name).extend(value)
        elif isinstance(value, dict):
            getattr(target, name).update(value)
        else:
            setattr(target, name, value)
    return request


BAD = [
    ({"beam_search__beam_width": 9}, "beam_search.beam_width must be in [1, 8]"),
    ({"beam_search__beam_width": 0}, "beam_search.beam_width must be in [1, 8]"),
    ({"beam_search__length_penalty": float("nan")}, "beam_search.length_penalty must be a"),
    ({"beam_search__early_stopping": 7}, "beam_search.early_stopping must be a BeamEarly"),
    ({"n": 5}, "n must be in [1, beam_search.beam_width=4]"),
    (
        {"sampling__temperature": 0.7},
        "sampling.temperature is not supported with beam_search (it ranks raw logprobs",
    ),
    (
        {"sampling__top_p": 0.9},
        "sampling.top_p is not supported with beam_search (it ranks raw logprobs",
    ),
    (
        {"sampling__top_k": 5},
        "sampling.top_k is not supported with beam_search (it ranks raw logprobs",
    ),
    (
        {"sampling__min_p": 0.1},
        "sampling.min_p is not supported with beam_search (it ranks raw logprobs",
    ),
    (
        {"sampling__repetition_penalty": 1.2},
        "sampling.repetition_penalty is not supported with beam_search (it ranks raw logprobs",
    ),
    (
        {"sampling__presence_penalty": 0.5},
        "sampling.presence_penalty is not supported with beam_search (it ranks raw logprobs",
    ),
    (
        {"sampling__frequency_penalty": 0.5},
        "sampling.frequency_penalty is not supported with beam_search (it ranks raw logprobs",
    ),
    ({"sampling__logit_bias": {5: 1.0}}, "sampling.logit_bias is not supported with beam_search"),
    ({"logprobs": 2}, "logprobs is not supported with beam_search"),
    ({"prompt_logprobs": 1}, "prompt_logprobs is not supported with beam_search"),
    ({"stopping__stop": ["abc"]}, "stopping.stop is not supported with beam_search"),
    ({"stopping__min_tokens": 2}, "stopping.min_tokens is not supported with beam_search"),
    ({"structured_output__regex": "[a-z]+"}, "structured_output is not supported with beam_search"),
]


@pytest.mark.parametrize(("changes", "message"), BAD, ids=[m for _, m in BAD])
def test_unsupported_combinations_are_invalid_argument(arch, changes, message):
    stack = stack_for(arch, "split")
    with pytest.raises(grpc.RpcError) as error:
        run_beam(stack.spec.gateway_address, refused(**changes))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details(), error.value.details()


TOO_MANY_STOP_IDS = "stopping.stop_token_ids: with beam_search"


def beam_documented_messages() -> list[str]:
    """The error texts of docs/api.md's beam search table (the fuzz oracle reads them too)."""
    return documented_messages("beam-validation-table")


def test_docs_beam_table_and_tested_refusals_agree():
    tested = [m for _, m in BAD] + [TOO_MANY_STOP_IDS]
    documented = beam_documented_messages()
    assert len(documented) == 12
    for row in documented:
        assert any(row in m or m in row for m in tested), f"docs row not tested: {row!r}"
    for message in tested:
        assert any(row in message or message in row for row in documented), message


def test_too_many_stop_tokens_for_the_width_is_invalid_argument(arch):
    stack = stack_for(arch, "split")
    request = beam_request(PROMPTS[0], 8, 1.0, False, 1, stop_ids=list(range(1, 9)))
    with pytest.raises(grpc.RpcError) as error:
        run_beam(stack.spec.gateway_address, request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert TOO_MANY_STOP_IDS in error.value.details()


def test_http_use_beam_search_gives_the_same_hypotheses(arch):
    """vLLM's `use_beam_search` + `n` (with the length_penalty / early_stopping extras) over
    HTTP: the n choices are the gRPC search's hypotheses (HF-checked above), best first."""
    stack = stack_for(arch, "split")
    prompt = PROMPTS[1]
    grpc_out = run_beam(stack.spec.gateway_address, beam_request(prompt, 4, 2.0, True, 4))
    body = {
        "prompt": prompt,
        "max_tokens": MAX_NEW,
        "use_beam_search": True,
        "n": 4,
        "length_penalty": 2.0,
        "early_stopping": True,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"http://{stack.spec.http_address}/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        answer = json.loads(reply.read())
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == [grpc_out[i]["text"] for i in range(4)]
    reasons = {generate_pb2.FINISH_REASON_STOP: "stop", generate_pb2.FINISH_REASON_LENGTH: "length"}
    expected_reasons = [reasons[grpc_out[i]["reason"]] for i in range(4)]
    assert [c["finish_reason"] for c in choices] == expected_reasons
    assert answer["usage"]["completion_tokens"] == sum(len(h["tokens"]) for h in grpc_out.values())


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_searches_stay_exact_beside_preemption(tiny_llama_dir, small_pools_stack, mode):
    """A decode pool of 10 blocks (the session's small-pools stack of that preemption
    mode): three long greedy requests and two beam searches queued together
    (`held_together`). The greedy ones alone grow to 15 blocks (40 + 40 tokens each), all
    decoding at once, so the pool must preempt (recompute) or swap out (swap); every
    output is still HF's and every block comes back. Which request the pool picks (a beam,
    whose search then starts over, or a greedy one) depends on where the searches are in
    their steps; that a lost beam restarts its search and stays exact is forced in-process
    (`test_beam_search_inprocess::test_lost_beams_restart_their_search_and_stay_exact`)."""
    stack = small_pools_stack(mode)  # shared: counters compared with before
    cases = [(4, 1.0, False, 2, 1, False), (8, 1.0, "never", 2, 0, False)]
    refs = [expected(tiny_llama_dir, case) for case in cases]
    before = pool_stats(stack).pools
    address = stack.spec.gateway_address
    long_prompts = [[(7 * i + j) % 1000 + 3 for j in range(40)] for i in range(3)]
    with ThreadPoolExecutor(5) as pool:
        with held_together(stack, 5):
            free = [pool.submit(generate, address, greedy_request(p, 40)) for p in long_prompts]
            searches = [
                pool.submit(run_beam, address, beam_request(prompt, *case[:4], stop_ids=eos))
                for case, (prompt, eos, _) in zip(cases, refs, strict=True)
            ]
        results = [f.result() for f in searches]
        outputs = [f.result() for f in free]
    for case, (_, _, hyps), got in zip(cases, refs, results, strict=True):
        assert [got[i]["tokens"] for i in range(case[3])] == [h[0] for h in hyps], case
    for prompt, out in zip(long_prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(tiny_llama_dir, prompt, 40)
    stats = wait_until_idle(stack)
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)
    if mode == "recompute":
        assert sum(p.preemptions for p in stats.pools) > sum(p.preemptions for p in before)
    else:
        assert sum(p.swap_outs for p in stats.pools) > sum(p.swap_outs for p in before)


def test_width_one_is_a_one_beam_search(arch):
    """beam_width 1 is the policy's one-beam search (HF runs greedy search for num_beams=1,
    so the reference is the policy driven by HF's model, as in its unit tests)."""
    from services.scheduler.beam_search import BeamParams
    from tests.unit.test_beam_search_policy import drive

    folder = arch[0]
    stack = stack_for(arch, "split")
    model = hf_model(str(folder))
    for prompt in PROMPTS:
        eos = [model.generation_config.eos_token_id, liked_token(folder, prompt)]
        eos = sorted(set(eos))
        got = run_beam(stack.spec.gateway_address, beam_request(prompt, 1, 2.0, False, 1, eos))
        params = BeamParams(
            beam_width=1,
            length_penalty=2.0,
            eos_token_ids=tuple(eos),
            max_new_tokens=MAX_NEW,
            prompt_len=len(prompt),
        )
        ours, _ = drive(model, prompt, params)
        assert got[0]["tokens"] == list(ours[0].tokens)
        assert got[0]["score"] == pytest.approx(ours[0].score, abs=1e-4)


def test_beam_search_beside_speculative_decoding(tiny_llama_dir, tmp_path):
    """A decode worker started with n-gram speculation (beams are planned without proposal
    slots): the searches stay HF's and a greedy neighbour stays HF's greedy."""
    ngram = json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
    )  # fmt: skip
    stack = start_stack(
        tiny_llama_dir, tmp_path / "run", extra_args={"decode": ["--speculative-config", ngram]}
    )
    try:
        address = stack.spec.gateway_address
        cases = [CASES[1], CASES[4]]
        refs = [expected(tiny_llama_dir, case) for case in cases]
        with ThreadPoolExecutor(3) as pool:
            free = pool.submit(generate, address, greedy_request(PROMPTS[1], 24))
            futures = [
                pool.submit(run_beam, address, beam_request(prompt, *case[:4], stop_ids=eos))
                for case, (prompt, eos, _) in zip(cases, refs, strict=True)
            ]
            results = [f.result() for f in futures]
        for case, (_, _, hyps), got in zip(cases, refs, results, strict=True):
            assert [got[i]["tokens"] for i in range(case[3])] == [h[0] for h in hyps], case
        assert free.result().token_ids == hf_greedy(tiny_llama_dir, PROMPTS[1], 24)
        stats = wait_until_idle(stack)
        assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)
    finally:
        stack.stop()
