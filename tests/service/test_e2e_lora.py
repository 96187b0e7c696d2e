"""Multi-LoRA through the real services: prefill and decode workers started with
`--enable-lora --lora-modules` (three PEFT-made adapters) and `--max-loras 2`; the same
prompt for each adapter and for the base model, all at once and twice over, gives each one
exactly HF + PEFT's merged greedy tokens (so neither the prefix cache nor the KV transfer
mixes adapters, and the scheduler keeps each step within two adapters); an unknown adapter
is NOT_FOUND on gRPC and 404 on HTTP, where the adapters are models named by `model`; the
pools end leak-free.

At run time (gateway started with --allow-runtime-lora-updating): an adapter loaded while
base requests run serves PEFT-exact output and leaves them exact; an unload refuses new
requests at once, lets the ones running on the adapter finish exactly, and returns after
them; the name loaded again from another folder serves the new adapter (its cached prefix
blocks are not reused); a decode worker killed and restarted gets the run-time adapter
back before its first step; bad loads fail with the status and reason and leave the
server serving; vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter do the same over
HTTP."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from tests.stack_client import (
    BackgroundStream,
    generate,
    greedy_request,
    pool_stats,
    wait_until_idle,
)
from tests.unit.test_lora_batched import adapters, peft_merged_greedy  # noqa: F401  (fixture)

PROMPT = [5, 17, 230, 44, 9, 310, 12, 8, 77, 501, 3, 66, 21, 90, 14, 7, 7, 300] * 2
NEW_TOKENS = 12


LONG_TOKENS = 120  # long enough to be running while an adapter loads or unloads


def lora_request(name: str | None, max_tokens: int = NEW_TOKENS):
    request = greedy_request(PROMPT, max_tokens)
    request.lora_name = name or ""
    return request


def call(address: str, method: str, request):
    with grpc.insecure_channel(address) as channel:
        return getattr(generate_pb2_grpc.GenerateServiceStub(channel), method)(request, timeout=60)


def load(address: str, name: str, path) -> generate_pb2.LoadLoraAdapterResponse:
    request = generate_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=str(path))
    return call(address, "LoadLoraAdapter", request)


def unload(address: str, name: str) -> None:
    call(address, "UnloadLoraAdapter", generate_pb2.UnloadLoraAdapterRequest(lora_name=name))


def listed(address: str) -> dict[str, tuple[str, str]]:
    reply = call(address, "ListLoraAdapters", generate_pb2.ListLoraAdaptersRequest())
    return {a.lora_name: (a.source, a.lora_path) for a in reply.adapters}


def refused(fn, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as failed:
        fn(*args)
    return failed.value


def all_at_once(address: str, requests) -> list:
    barrier = threading.Barrier(len(requests))

    def one(request):
        barrier.wait()
        return generate(address, request)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def post(address: str, path: str, body: dict | None = None, raw: bool = False):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{address}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        text = response.read()
    return text.decode() if raw else json.loads(text)


@pytest.fixture(scope="module")
def stack(module_stacks, adapters):  # noqa: F811
    modules = ",".join(f"{name}={folder}" for name, folder in adapters.items())
    lora = ["--enable-lora", "--lora-modules", modules, "--max-loras", "2"]
    return module_stacks(
        prefill=1,
        decode=1,
        http=True,
        extra_args={
            "prefill": lora,
            "decode": lora,
            "gateway": ["--allow-runtime-lora-updating"],
        },
    )


def test_adapters_and_base_in_one_stack_equal_peft(tiny_llama_dir, adapters, stack):  # noqa: F811
    names = [*adapters, None]
    expected = {n: peft_merged_greedy(tiny_llama_dir, adapters.get(n), PROMPT) for n in names}
    assert len({tuple(v) for v in expected.values()}) == len(names)
    address = stack.spec.gateway_address
    for _ in range(2):  # the second round finds each adapter's own cached prefix
        results = all_at_once(address, [lora_request(n) for n in names])
        for name, got in zip(names, results, strict=True):
            assert got.token_ids == expected[name], name
        wait_until_idle(stack)
    cli = subprocess.run(  # the CLI client names an adapter too
        [sys.executable, "-m", "services.client", ",".join(map(str, PROMPT)), "--token-ids",
         "--max-tokens", str(NEW_TOKENS), "--lora-name", "mlp16", "--address", address],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == generate(address, lora_request("mlp16")).text + "\n"
    with pytest.raises(grpc.RpcError) as unknown:
        generate(address, lora_request("nope"))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope'" in unknown.value.details() and "qv8" in unknown.value.details()

    http = stack.spec.http_address
    listed = [m["id"] for m in post(http, "/v1/models")["data"]]
    assert set(adapters) <= set(listed)
    body = {"model": "mlp16", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
    text = post(http, "/v1/completions", body)["choices"][0]["text"]
    assert text == generate(address, lora_request("mlp16")).text
    with pytest.raises(urllib.error.HTTPError) as missing:
        post(http, "/v1/completions", body | {"model": "nope"})
    assert missing.value.code == 404
    stats = wait_until_idle(stack)
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)


def test_adapters_load_and_unload_at_run_time_under_load(tiny_llama_dir, adapters, stack, tmp_path):  # noqa: F811
    address, http = stack.spec.gateway_address, stack.spec.http_address
    base_long = peft_merged_greedy(tiny_llama_dir, None, PROMPT, LONG_TOKENS)
    mlp_long = peft_merged_greedy(tiny_llama_dir, adapters["mlp16"], PROMPT, LONG_TOKENS)
    qv8 = peft_merged_greedy(tiny_llama_dir, adapters["qv8"], PROMPT)
    assert listed(address) == {n: ("startup", "") for n in adapters}

    # Loaded while base requests run: they stay exact, the new name serves PEFT's output.
    base_streams = [BackgroundStream(address, lora_request(None, LONG_TOKENS)) for _ in range(3)]
    for s in base_streams:
        s.wait_tokens(2)
    reply = load(address, "rt", adapters["mlp16"])
    assert (reply.adapter.lora_name, reply.adapter.source) == ("rt", "runtime")
    assert listed(address)["rt"] == ("runtime", str(adapters["mlp16"]))
    assert generate(address, lora_request("rt")).token_ids == mlp_long[:NEW_TOKENS]
    for s in base_streams:
        assert s.result().code == grpc.StatusCode.OK and s.token_ids == base_long

    # Unloaded while requests run on it: new ones are refused at once, running ones finish
    # exactly, and the call returns only after them.
    streams = [BackgroundStream(address, lora_request("rt", LONG_TOKENS)) for _ in range(3)]
    for s in streams:
        s.wait_tokens(2)
    unloading = BackgroundUnload(address, "rt", lambda: pool_stats(stack).num_requests)
    wait_for(lambda: "rt" not in listed(address))
    late = refused(generate, address, lora_request("rt"))
    assert late.code() == grpc.StatusCode.NOT_FOUND and "'rt'" in late.details()
    unloading.join(60)
    assert unloading.requests_left == 0  # it returned only once they had all finished
    for s in streams:
        assert s.result().code == grpc.StatusCode.OK and s.token_ids == mlp_long

    # The same name from another folder: the new adapter, not the old one's cached prefix.
    load(address, "rt", adapters["qv8"])
    assert generate(address, lora_request("rt")).token_ids == qv8

    # A decode worker that dies and comes back holds only its --lora-modules; the scheduler
    # loads "rt" into it before its first step.
    decode = next(p.name for p in stack.processes if p.name.startswith("decode"))
    stack.signal(decode, signal.SIGKILL)
    wait_for(lambda: not all(p.healthy for p in pool_stats(stack).pools), timeout_s=60)
    stack.restart(decode)
    wait_for(lambda: all(p.healthy for p in pool_stats(stack).pools), timeout_s=60)
    assert generate(address, lora_request("rt")).token_ids == qv8

    # Bad loads say why and change nothing.
    bad = tmp_path / "not-an-adapter"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"r": 8, "use_dora": True}))
    error = refused(load, address, "bad", bad)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "DoRA" in error.details()
    error = refused(load, address, "missing", tmp_path / "nowhere")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "adapter_config" in error.details()
    assert refused(load, address, "qv8", adapters["qv8"]).code() == grpc.StatusCode.ALREADY_EXISTS
    model_name = call(address, "GetModelInfo", generate_pb2.GetModelInfoRequest()).model_name
    error = refused(load, address, model_name, adapters["qv8"])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "base model" in error.details()
    assert refused(load, address, "", adapters["qv8"]).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused(unload, address, "nope").code() == grpc.StatusCode.NOT_FOUND
    assert set(listed(address)) == {*adapters, "rt"}
    assert generate(address, lora_request("rt")).token_ids == qv8

    # vLLM's HTTP endpoints.
    web = {"lora_name": "web", "lora_path": str(adapters["mlp16"])}
    said = post(http, "/v1/load_lora_adapter", web, raw=True)
    assert said == "Success: LoRA adapter 'web' added successfully."
    assert "web" in [m["id"] for m in post(http, "/v1/models")["data"]]
    body = {"model": "web", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
    text = post(http, "/v1/completions", body)["choices"][0]["text"]
    over_grpc = generate(address, lora_request("web"))
    assert over_grpc.token_ids == mlp_long[:NEW_TOKENS] and text == over_grpc.text
    said = post(http, "/v1/unload_lora_adapter", {"lora_name": "web"}, raw=True)
    assert said == "Success: LoRA adapter 'web' removed successfully."
    for path, payload, status in [
        ("/v1/completions", body, 404),
        ("/v1/unload_lora_adapter", {"lora_name": "web"}, 404),
        ("/v1/load_lora_adapter", {"lora_name": "web"}, 400),
        ("/v1/load_lora_adapter", {"lora_name": "qv8", "lora_path": str(adapters["qv8"])}, 400),
    ]:
        with pytest.raises(urllib.error.HTTPError) as failed:
            post(http, path, payload)
        assert failed.value.code == status, (path, payload)

    unload(address, "rt")
    assert set(listed(address)) == set(adapters)
    stats = wait_until_idle(stack)
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)


class BackgroundUnload(threading.Thread):
    """An unload on a thread; `requests_left`: the scheduler's unfinished requests the
    moment it returned."""

    def __init__(self, address: str, name: str, num_requests) -> None:
        super().__init__(daemon=True)
        self.address, self.name, self.num_requests = address, name, num_requests
        self.requests_left = None
        self.start()

    def run(self) -> None:
        unload(self.address, self.name)
        self.requests_left = self.num_requests()


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def peft_merged_beams(base_dir, adapter_dir, prompt, num_beams: int, n: int, max_new: int):
    """HF + PEFT's merged model: generate(num_beams, do_sample=False)'s n best, unpadded."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        hf = PeftModel.from_pretrained(hf, adapter_dir).merge_and_unload()
    eos = hf.generation_config.eos_token_id
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            num_beams=num_beams,
            num_return_sequences=n,
            max_new_tokens=max_new,
            eos_token_id=[eos],
            pad_token_id=eos,
            return_dict_in_generate=True,
        )
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    start = len(prompt)
    return [row[start : start + k].tolist() for row, k in zip(out.sequences, lengths, strict=True)]


def test_beam_search_with_an_adapter_equals_peft(tiny_llama_dir, adapters, stack):  # noqa: F811
    """Every beam of a search carries its adapter: a beam search on an adapter and one on
    the base model, at once, each equal HF + PEFT's merged beam search."""
    from tests.service.test_e2e_beam_search import run_beam

    name = next(iter(adapters))
    address = stack.spec.gateway_address
    requests = []
    for lora in (name, None):
        request = generate_pb2.GenerateRequest(max_tokens=NEW_TOKENS, n=2, lora_name=lora or "")
        request.token_ids.ids.extend(PROMPT)
        request.beam_search.beam_width = 4
        requests.append(request)
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda r: run_beam(address, r), requests))
    for lora, result in zip((name, None), got, strict=True):
        want = peft_merged_beams(tiny_llama_dir, adapters.get(lora), PROMPT, 4, 2, NEW_TOKENS)
        assert [result[i]["tokens"] for i in range(2)] == want, lora
    assert got[0][0]["tokens"] != got[1][0]["tokens"]  # the adapter matters
    wait_until_idle(stack)
