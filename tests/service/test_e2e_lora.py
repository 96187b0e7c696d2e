"""Multi-LoRA through the real services: prefill and decode workers started with
`--enable-lora --lora-modules` (three PEFT-made adapters) and `--max-loras 2`; the same
prompt for each adapter and for the base model, all at once and twice over, gives each one
exactly HF + PEFT's merged greedy tokens (so neither the prefix cache nor the KV transfer
mixes adapters, and the scheduler keeps each step within two adapters); an unknown adapter
is NOT_FOUND on gRPC and 404 on HTTP, where the adapters are models named by `model`; the
pools end leak-free."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.stack_client import generate, greedy_request, start_stack, wait_until_idle
from tests.unit.test_lora_batched import adapters, peft_merged_greedy  # noqa: F401  (fixture)

PROMPT = [5, 17, 230, 44, 9, 310, 12, 8, 77, 501, 3, 66, 21, 90, 14, 7, 7, 300] * 2
NEW_TOKENS = 12


def lora_request(name: str | None):
    request = greedy_request(PROMPT, NEW_TOKENS)
    request.lora_name = name or ""
    return request


def all_at_once(address: str, requests) -> list:
    barrier = threading.Barrier(len(requests))

    def one(request):
        barrier.wait()
        return generate(address, request)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def post(address: str, path: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{address}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_adapters_and_base_in_one_stack_equal_peft(tiny_llama_dir, adapters, tmp_path):  # noqa: F811
    modules = ",".join(f"{name}={folder}" for name, folder in adapters.items())
    lora = ["--enable-lora", "--lora-modules", modules, "--max-loras", "2"]
    stack = start_stack(
        tiny_llama_dir,
        tmp_path / "run",
        prefill=1,
        decode=1,
        http=True,
        extra_args={"prefill": lora, "decode": lora},
    )
    try:
        names = [*adapters, None]
        expected = {n: peft_merged_greedy(tiny_llama_dir, adapters.get(n), PROMPT) for n in names}
        assert len({tuple(v) for v in expected.values()}) == len(names)
        address = stack.spec.gateway_address
        for _ in range(2):  # the second round finds each adapter's own cached prefix
            results = all_at_once(address, [lora_request(n) for n in names])
            for name, got in zip(names, results, strict=True):
                assert got.token_ids == expected[name], name
            wait_until_idle(stack)
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
    finally:
        stack.stop()
