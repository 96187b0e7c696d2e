"""The generation API end to end on the real services (prefill + decode worker, KV over
UCX), checked against `transformers`: chat templates, Tokenize/Detokenize, greedy and its
equivalents, penalties, logit bias, min_tokens, stop tokens and strings, logprobs, seeded
sampling under different batching and topologies, n samples sharing the prompt's blocks.
After each scenario every pool is back to all-free."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from google.protobuf import json_format

from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from tests.hf_reference import (
    hf_generate,
    hf_greedy,
    hf_log_softmax,
    hf_model,
    hf_tokenizer,
)
from tests.stack_client import held_together, pool_stats, start_stack, wait_until_idle

PROMPT = "Once upon a time, the scheduler"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about paged attention."},
    {"role": "assistant", "content": "Blocks."},
    {"role": "user", "content": "More, naïvely: 中文 🚀"},
]


def request(prompt=PROMPT, **fields) -> generate_pb2.GenerateRequest:
    body = dict(fields)
    if isinstance(prompt, str):
        body["text"] = prompt
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        body["chat"] = {"messages": prompt}
    else:
        body["token_ids"] = {"ids": prompt}
    return json_format.ParseDict(body, generate_pb2.GenerateRequest())


class Result:
    """A Generate stream, gathered per sample."""

    def __init__(self, messages: list[generate_pb2.GenerateResponse]) -> None:
        self.messages = messages
        self.last = messages[-1]
        indices = sorted({m.index for m in messages})
        self.ids = {i: [t for m in messages if m.index == i for t in m.token_ids] for i in indices}
        self.text = {i: "".join(m.text for m in messages if m.index == i) for i in indices}
        self.logprobs = {
            i: [lp for m in messages if m.index == i for lp in m.logprobs] for i in indices
        }
        self.finals = {m.index: m for m in messages if m.finish_reason}


def run(stub, req: generate_pb2.GenerateRequest) -> Result:
    return Result(list(stub.Generate(req, timeout=120)))


@pytest.fixture(scope="module")
def stub(api_stack):
    with grpc.insecure_channel(api_stack.spec.gateway_address) as channel:
        yield generate_pb2_grpc.GenerateServiceStub(channel)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return hf_tokenizer(str(tiny_llama_dir))


@pytest.fixture(autouse=True)
def pools_back_to_all_free(api_stack):
    yield
    wait_until_idle(api_stack)


def test_chat_messages_render_exactly_like_apply_chat_template(stub, tok, tiny_llama_dir):
    for add in (True, False):
        want = tok.apply_chat_template(MESSAGES, add_generation_prompt=add)["input_ids"]
        chat = {"messages": MESSAGES, "add_generation_prompt": add}
        got = stub.Tokenize(json_format.ParseDict({"chat": chat}, generate_pb2.TokenizeRequest()))
        assert list(got.token_ids) == want
        assert list(got.tokens) == tok.convert_ids_to_tokens(want)
    # continue_final_message: the last turn left open (no generation prompt unless asked).
    partial = [*MESSAGES, {"role": "assistant", "content": "Sure, the"}]
    want = tok.apply_chat_template(partial, continue_final_message=True)["input_ids"]
    chat = {"messages": partial, "continue_final_message": True}
    got = stub.Tokenize(json_format.ParseDict({"chat": chat}, generate_pb2.TokenizeRequest()))
    assert list(got.token_ids) == want
    with pytest.raises(grpc.RpcError) as both:
        chat["add_generation_prompt"] = True
        stub.Tokenize(json_format.ParseDict({"chat": chat}, generate_pb2.TokenizeRequest()))
    assert both.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not compatible" in both.value.details()
    prompt_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    result = run(stub, request(MESSAGES, max_tokens=12, sampling={"temperature": 0}))
    assert result.ids[0] == hf_greedy(tiny_llama_dir, prompt_ids, 12)
    assert result.last.usage.prompt_tokens == len(prompt_ids)


def test_tokenize_detokenize_models_and_load(stub, tok, api_stack):
    text = "naïve café, 中文 🚀 and </s> specials"
    got = stub.Tokenize(generate_pb2.TokenizeRequest(text=text))
    assert list(got.token_ids) == tok.encode(text) and got.max_model_len == 512
    ids = list(got.token_ids)
    for skip in (True, False):
        detok = stub.Detokenize(
            generate_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip)
        )
        assert detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert "</s>" not in stub.Detokenize(generate_pb2.DetokenizeRequest(token_ids=ids)).text
    info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
    assert info.has_chat_template and info.vocab_size >= len(tok)
    assert list(stub.ListModels(generate_pb2.ListModelsRequest()).models) == [info]
    wait_until_idle(api_stack)
    load = stub.GetServerLoad(generate_pb2.GetServerLoadRequest())
    assert load.num_requests == 0 and load.kv_cache_usage == 0.0
    assert sorted(w.role for w in load.workers) == ["decode", "prefill"]
    assert all(w.num_free_blocks == w.num_blocks > 0 for w in load.workers)


def test_lora_calls_without_runtime_updating_are_refused(stub):
    """A stack without --enable-lora lists no adapters, and a gateway without
    --allow-runtime-lora-updating refuses loads and unloads, naming the flag."""
    assert not stub.ListLoraAdapters(generate_pb2.ListLoraAdaptersRequest()).adapters
    calls = [
        (stub.LoadLoraAdapter, generate_pb2.LoadLoraAdapterRequest(lora_name="a", lora_path="/x")),
        (stub.UnloadLoraAdapter, generate_pb2.UnloadLoraAdapterRequest(lora_name="a")),
    ]
    for method, request in calls:
        with pytest.raises(grpc.RpcError) as refused:
            method(request)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--allow-runtime-lora-updating" in refused.value.details()


def test_greedy_equals_temperature_zero_and_top_k_one(stub, tok, tiny_llama_dir):
    want = hf_greedy(tiny_llama_dir, tok.encode(PROMPT), 20)
    assert run(stub, request(max_tokens=20, sampling={"temperature": 0})).ids[0] == want
    top1 = request(max_tokens=20, sampling={"temperature": 1.3, "top_k": 1, "seed": 3})
    assert run(stub, top1).ids[0] == want
    tiny_p = request(max_tokens=20, sampling={"temperature": 0.7, "top_p": 1e-6})
    assert run(stub, tiny_p).ids[0] == want


def test_repetition_penalty_equals_hf_generate(stub, tok, tiny_llama_dir):
    prompt = tok.encode("the the the scheduler scheduler said said")
    got = run(
        stub, request(prompt, max_tokens=24, sampling={"temperature": 0, "repetition_penalty": 1.6})
    )
    want = hf_generate(tiny_llama_dir, prompt, max_new_tokens=24, repetition_penalty=1.6)
    assert got.ids[0] == want
    assert want != hf_greedy(tiny_llama_dir, prompt, 24)  # the penalty changed the output


def test_min_tokens_and_stop_token_ids_equal_hf_generate(stub, tok, tiny_llama_dir):
    prompt = tok.encode(PROMPT)
    free = hf_greedy(tiny_llama_dir, prompt, 30)
    stop_id = free[2]
    first_after = next((i for i in range(6, 30) if free[i] == stop_id), None)
    eos = hf_model(str(tiny_llama_dir)).generation_config.eos_token_id
    stopping = {"stop_token_ids": [stop_id], "min_tokens": 6}
    got = run(stub, request(prompt, max_tokens=30, sampling={"temperature": 0}, stopping=stopping))
    want = hf_generate(
        tiny_llama_dir, prompt, max_new_tokens=30, min_new_tokens=6, eos_token_id=[eos, stop_id]
    )
    assert got.ids[0] == want and want[2] != stop_id  # suppressed while below min_tokens
    final = got.finals[0]
    if want[-1] == stop_id:
        assert final.finish_reason == generate_pb2.FINISH_REASON_STOP
        assert final.stop_token_id == stop_id
        assert got.text[0] == tok.decode(want[:-1], skip_special_tokens=True)
    else:
        assert first_after is None and final.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    # Without min_tokens it stops at the first occurrence, token text left out.
    got = run(
        stub,
        request(
            prompt,
            max_tokens=30,
            sampling={"temperature": 0},
            stopping={"stop_token_ids": [stop_id]},
        ),
    )
    assert got.ids[0] == free[:3] and got.finals[0].stop_token_id == stop_id
    assert got.text[0] == tok.decode(free[:2], skip_special_tokens=True)


def test_logit_bias_equals_hf_sequence_bias(stub, tok, tiny_llama_dir):
    prompt = tok.encode(PROMPT)
    free = hf_greedy(tiny_llama_dir, prompt, 16)
    bias = {free[0]: -100.0, free[3]: -100.0, 40: 4.0, 77: 2.5}
    got = run(
        stub,
        request(
            prompt,
            max_tokens=16,
            sampling={"temperature": 0, "logit_bias": {str(k): v for k, v in bias.items()}},
        ),
    )
    want = hf_generate(
        tiny_llama_dir, prompt, max_new_tokens=16, sequence_bias={(k,): v for k, v in bias.items()}
    )
    assert got.ids[0] == want and want != free


def test_presence_and_frequency_penalties_match_a_reference_loop(stub, tok, tiny_llama_dir):
    prompt = tok.encode("to be or not to be, that is")
    presence, frequency = 1.5, 0.75
    got = run(
        stub,
        request(
            prompt,
            max_tokens=20,
            sampling={
                "temperature": 0,
                "presence_penalty": presence,
                "frequency_penalty": frequency,
            },
        ),
    )
    out: list[int] = []
    for _ in range(20):
        logits = hf_model(str(tiny_llama_dir))(torch.tensor([prompt + out])).logits[0, -1].float()
        for token in set(out):
            logits[token] -= presence + frequency * out.count(token)
        out.append(int(logits.argmax()))
        if out[-1] == tok.eos_token_id:
            break
    assert got.ids[0] == out
    assert out != hf_greedy(tiny_llama_dir, prompt, 20)


def test_logprobs_and_prompt_logprobs_match_hf_log_softmax(stub, tok, tiny_llama_dir):
    prompt = tok.encode(PROMPT)
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 11, "top_k": 20}):
        got = run(
            stub, request(prompt, max_tokens=10, logprobs=3, prompt_logprobs=2, sampling=sampling)
        )
        ids = got.ids[0]
        reference = hf_log_softmax(tiny_llama_dir, prompt + ids)
        assert len(got.logprobs[0]) == len(ids)
        for position, (token, entry) in enumerate(zip(ids, got.logprobs[0], strict=True)):
            row = reference[len(prompt) - 1 + position]
            assert entry.token_id == token and entry.token == tok.decode([token])
            assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
            top = row.topk(3)
            assert [t.token_id for t in entry.top_logprobs] == top.indices.tolist()
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
                top.values.tolist(), abs=1e-4
            )
        prompt_entries = got.messages[0].prompt_logprobs
        assert [e.token_id for e in prompt_entries] == prompt[1:]
        for position, entry in enumerate(prompt_entries, start=1):
            row = reference[position - 1]
            assert entry.logprob == pytest.approx(row[prompt[position]].item(), abs=1e-4)
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].token_id == int(row.argmax())


def boundary_stop(tok, ids: list[int]) -> tuple[str, int]:
    """A stop string of the decoded output that starts inside one token and ends inside the
    next; returns it and the index of the token that first completes it."""
    for i in range(2, len(ids) - 2):
        before, upto, after = (tok.decode(ids[:k]) for k in (i, i + 1, i + 2))
        if len(upto) - len(before) >= 2 and len(after) - len(upto) >= 2 and "\ufffd" not in after:
            stop = after[len(upto) - 1 : len(upto) + 1]
            completing = next(k for k in range(len(ids)) if stop in tok.decode(ids[: k + 1]))
            return stop, completing
    raise AssertionError("no two consecutive multi-character tokens")


def test_stop_string_split_across_tokens_is_cut_and_the_sample_freed(
    stub, tok, tiny_llama_dir, api_stack
):
    prompt = tok.encode(PROMPT)
    free = hf_greedy(tiny_llama_dir, prompt, 40)
    stop, completing = boundary_stop(tok, free)
    free_text = tok.decode(free, skip_special_tokens=True)
    cut = free_text.index(stop)
    for include in (False, True):
        got = run(
            stub,
            request(
                prompt,
                max_tokens=40,
                sampling={"temperature": 0},
                stopping={"stop": ["never-there", stop], "include_stop_str_in_output": include},
            ),
        )
        assert got.text[0] == free_text[: cut + (len(stop) if include else 0)]
        assert got.finals[0].finish_reason == generate_pb2.FINISH_REASON_STOP
        assert got.finals[0].stop_string == stop
        assert got.ids[0] == free[: completing + 1]
        assert got.last.usage.completion_tokens == completing + 1
        wait_until_idle(api_stack)  # the aborted sample's blocks are back


def test_ignore_eos_and_skip_special_tokens(stub, tok):
    eos = tok.eos_token_id
    forced = {"temperature": 0, "logit_bias": {str(eos): 100.0}}
    got = run(stub, request(max_tokens=5, sampling=forced))
    assert got.ids[0] == [eos] and got.finals[0].stop_token_id == eos and got.text[0] == ""
    got = run(stub, request(max_tokens=5, sampling=forced, stopping={"ignore_eos": True}))
    assert got.ids[0] == [eos] * 5
    assert got.finals[0].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert got.text[0] == ""
    got = run(
        stub,
        request(
            max_tokens=5,
            sampling=forced,
            stopping={"ignore_eos": True, "skip_special_tokens": False},
        ),
    )
    assert got.text[0] == tok.eos_token * 5


def seeded(seed: int, n: int | None = None, prompt=PROMPT) -> generate_pb2.GenerateRequest:
    fields = {
        "max_tokens": 24,
        "sampling": {
            "temperature": 0.9,
            "top_p": 0.95,
            "seed": seed,
            "repetition_penalty": 1.1,
            "min_p": 0.02,
        },
    }
    if n is not None:
        fields["n"] = n
    return request(prompt, **fields)


def concurrently(address: str, requests: list, held=None) -> list[Result]:
    """`requests` (n = 1) at once. `held`: the stack behind `address`, whose scheduler then
    queues them all before any prompt step runs (`held_together`), however loaded the box."""
    barrier = threading.Barrier(len(requests))

    def one(req):
        with grpc.insecure_channel(address) as channel:
            if held is None:
                barrier.wait()
            return run(generate_pb2_grpc.GenerateServiceStub(channel), req)

    with ThreadPoolExecutor(len(requests)) as pool:
        if held is None:
            return list(pool.map(one, requests))
        with held_together(held, len(requests)):
            futures = [pool.submit(one, r) for r in requests]
        return [f.result() for f in futures]


def noise_requests(tok, count: int) -> list:
    rng = random.Random(5)
    return [
        request(
            [rng.randrange(3, len(tok)) for _ in range(rng.randrange(3, 60))],
            max_tokens=rng.randrange(5, 40),
            sampling={"temperature": 1.0},
        )
        for _ in range(count)
    ]


def test_seeded_sampling_is_reproducible_whatever_the_batch(stub, tok, api_stack):
    alone = run(stub, seeded(7)).ids[0]
    assert run(stub, seeded(7)).ids[0] == alone
    assert run(stub, seeded(8)).ids[0] != alone
    mixed = concurrently(api_stack.spec.gateway_address, [seeded(7), *noise_requests(tok, 6)])
    assert mixed[0].ids[0] == alone
    group = run(stub, seeded(5, n=3))
    for i in range(3):
        assert group.ids[i] == run(stub, seeded(5 + i)).ids[0]


def test_n_samples_share_the_prompts_blocks_and_release_them(stub, api_stack):
    rng = random.Random(9)
    prompt = [rng.randrange(3, 1000) for _ in range(40)]  # 2 full blocks before the last token
    before = {p.worker_id: p for p in pool_stats(api_stack).pools}
    got = run(stub, request(prompt, n=4, max_tokens=8, sampling={"temperature": 1.0, "seed": 1}))
    assert sorted(got.finals) == [0, 1, 2, 3]
    assert all(len(got.ids[i]) == 8 for i in range(4))
    assert len({tuple(got.ids[i]) for i in range(4)}) > 1
    usage = got.last.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (40, 32, 0)
    after = wait_until_idle(api_stack)
    prefill = [p for p in after.pools if p.role == 1]
    hits = sum(p.prefix_hit_tokens - before[p.worker_id].prefix_hit_tokens for p in prefill)
    assert hits == 3 * 32  # samples 1..3 reused sample 0's two full prompt blocks
    assert all(p.num_free_blocks == p.num_blocks for p in after.pools)


def test_cancelled_n_sample_request_frees_every_block(stub, api_stack):
    call = stub.Generate(request(n=3, max_tokens=400, sampling={"temperature": 1.0}), timeout=60)
    next(call)
    call.cancel()
    wait_until_idle(api_stack)


def test_usage_counts_cached_tokens_and_timings_are_ordered(stub, tok):
    prompt = [5 + (i * 7) % 900 for i in range(50)]
    run(stub, request(prompt, max_tokens=4, sampling={"temperature": 0}))
    got = run(stub, request(prompt, max_tokens=6, sampling={"temperature": 0}))
    usage, timings = got.last.usage, got.last.timings
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (50, 6, 48)
    assert 0 < timings.ttft_ms <= timings.e2e_ms and timings.mean_itl_ms > 0
    assert all(not m.HasField("usage") for m in got.messages[:-1])


def test_seeded_outputs_survive_preemption_on_a_both_worker(stub, tok, tiny_llama_dir, tmp_path):
    # The same seeded requests on one 'both' worker with a pool so small that some are
    # preempted and recomputed: the tokens equal the disaggregated stack's. Certain: the 6
    # (13-18 token prompts: 3 steps of 32) are queued together (`held_together`), and one
    # worker runs every step, so all 6 decode 24 tokens side by side, to 3 blocks each:
    # 18 blocks in a pool of 10.
    requests = [seeded(21 + i, prompt=PROMPT + " " * i) for i in range(6)]
    want = [run(stub, r).ids[0] for r in requests]
    assert all(len(w) == 24 for w in want)  # (none ends early: the arithmetic above)
    stack = start_stack(
        tiny_llama_dir,
        tmp_path / "both",
        prefill=0,
        decode=0,
        both=1,
        extra_args={
            "both": ["--num-blocks", "10", "--max-model-len", "96"],
            "scheduler": ["--max-num-batched-tokens", "32"],
        },
    )
    try:
        got = concurrently(stack.spec.gateway_address, requests, held=stack)
        assert [g.ids[0] for g in got] == want
        stats = wait_until_idle(stack)
        assert stats.pools[0].preemptions > 0
    finally:
        stack.stop()
