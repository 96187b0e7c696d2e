"""The client of `bench.multiturn`: OpenAI `/v1/completions` over HTTP, streamed (SSE),
the same for every server (Tandem's HTTP front, `vllm serve`).

Prompts go as token ids, so both servers get the same prompt to the token; answers come
back as token ids (vLLM's `return_token_ids`, which Tandem's front speaks too) and are fed
back into the next turn's prompt as they are. Greedy, EOS ignored, usage on the last chunk
(`prompt_tokens_details.cached_tokens`: prompt tokens the server did not compute). Plain
asyncio and one connection per turn (`Connection: close`), standard library only.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from bench.metrics import RequestRecord, e2e_s, ttft_s
from bench.multiturn_workload import Config, Conversation, reusable_tokens, turn_prompt


class HttpError(RuntimeError):
    pass


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


@dataclass
class Turn:
    conversation: int
    turn: int
    record: RequestRecord
    reusable_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)

    def row(self) -> dict:
        r = self.record
        return {
            "conversation": self.conversation,
            "turn": self.turn + 1,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "reusable_tokens": self.reusable_tokens,
            "ttft_ms": _ms(ttft_s(r)),
            "e2e_ms": _ms(e2e_s(r)),
            "error": r.error,
        }


def served_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model a server lists on /v1/models."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=timeout_s) as reply:
        return json.loads(reply.read())["data"][0]["id"]


def completion_body(model: str, prompt: Sequence[int], max_tokens: int, salt: str) -> dict:
    return {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "cache_salt": salt,
    }


async def _read_chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF
        yield data


async def _read_plain(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while data := await reader.read(65536):
        yield data


async def sse_events(base_url: str, path: str, body: dict) -> AsyncIterator[dict]:
    """POST `body` as JSON and yield each server-sent event's JSON until `[DONE]`."""
    url = urlsplit(base_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Connection: close\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        writer.write(head.encode() + payload)
        await writer.drain()
        status = (await reader.readline()).decode().split(" ", 2)
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        pieces = _read_chunked(reader) if chunked else _read_plain(reader)
        if len(status) < 2 or status[1] != "200":
            text = b"".join([piece async for piece in pieces]).decode(errors="replace")
            raise HttpError(f"HTTP {' '.join(status[1:]).strip()}: {text[:500]}")
        buffer = b""
        async for piece in pieces:
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    yield json.loads(data)
    finally:
        writer.close()


async def stream_turn(
    base_url: str, body: dict, turn: Turn, start: float, timeout_s: float
) -> None:
    """Send one turn and record what came back (a message with token ids is a token
    arrival; the usage chunk gives prompt and cached tokens)."""
    record = turn.record
    record.send_s = time.perf_counter() - start
    try:
        async with asyncio.timeout(timeout_s):
            async for event in sse_events(base_url, "/v1/completions", body):
                for choice in event.get("choices") or ():
                    ids = choice.get("token_ids") or []
                    if ids:
                        record.message_s.append(time.perf_counter() - start)
                        record.message_tokens.append(len(ids))
                        turn.token_ids.extend(ids)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                if usage := event.get("usage"):
                    record.usage_prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens") or 0
        record.end_s = time.perf_counter() - start
        if len(turn.token_ids) != body["max_tokens"]:
            record.error = f"{len(turn.token_ids)} token ids back, not {body['max_tokens']}"
    except (OSError, HttpError, TimeoutError, ValueError) as error:
        record.error = f"{type(error).__name__}: {error}"


async def converse(base_url, model, conversation: Conversation, config: Config, gate, salt,
                   start, out: list[Turn]) -> None:  # fmt: skip
    """One conversation's turns in order, each waiting for a slot among those in flight;
    stops at a failed turn (its history would be wrong)."""
    answers: list[list[int]] = []
    for k in range(config.turns):
        prompt = turn_prompt(conversation, k, answers)
        index = conversation.index * config.turns + k
        record = RequestRecord(index, len(prompt), config.max_tokens)
        turn = Turn(conversation.index, k, record, reusable_tokens(config, conversation, k))
        out.append(turn)
        body = completion_body(model, prompt, config.max_tokens, salt)
        async with gate:
            await stream_turn(base_url, body, turn, start, config.request_timeout_s)
        if not turn.record.ok:
            return
        answers.append(turn.token_ids)


async def _drive(base_url: str, model: str, conversations, config: Config):
    turns: list[Turn] = []
    gate = asyncio.Semaphore(config.max_in_flight)
    salt = f"bench-multiturn-{uuid.uuid4().hex}"
    start = time.perf_counter()
    await asyncio.gather(
        *(converse(base_url, model, c, config, gate, salt, start, turns) for c in conversations)
    )
    wall = time.perf_counter() - start
    turns.sort(key=lambda t: (t.conversation, t.turn))
    return turns, wall


def drive(base_url: str, model: str, conversations, config: Config) -> tuple[list[Turn], float]:
    """Every conversation to its end (or first failure): the turns and the wall time."""
    return asyncio.run(_drive(base_url, model, conversations, config))


def warm_up(base_url: str, model: str, vocab: Sequence[int], timeout_s: float = 300.0) -> None:
    """Two short concurrent turns, not measured, under their own salt (first requests,
    allocators, threads; vLLM's compiled shapes)."""
    salt = f"bench-multiturn-warm-up-{uuid.uuid4().hex}"

    async def both() -> list[Turn]:
        turns = [Turn(-1, i, RequestRecord(i, 32, 8)) for i in range(2)]
        prompts = [list(vocab[i * 32 : i * 32 + 32]) for i in range(2)]
        await asyncio.gather(*(
            stream_turn(base_url, completion_body(model, p, 8, salt), t, 0.0, timeout_s)
            for p, t in zip(prompts, turns, strict=True)
        ))  # fmt: skip
        return turns

    failed = [t.record.error for t in asyncio.run(both()) if not t.record.ok]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")
