"""`python -m services.client "prompt"`: stream a completion from the gateway to the terminal.

Text goes to stdout as it arrives (with `--n` > 1, each sample is printed whole at the end,
under a header); a summary (tokens, finish reason, time to first token, tokens/s) goes to
stderr. Exit status 1 with the gRPC status on failure.

TLS follows the `TANDEM_TLS_*` environment like the services (`common/tls.py`); `--api-key`
(default: `TANDEM_API_KEY`) is sent as `authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import grpc

from common.auth import bearer_metadata
from common.grpc_server import open_sync_channel
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from common.tls import tls_from_env


def build_request(args: argparse.Namespace) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest()
    if args.token_ids:
        request.token_ids.ids.extend(int(t) for t in args.prompt.split(","))
    elif args.chat:
        if args.system:
            request.chat.messages.add(role="system", content=args.system)
        request.chat.messages.add(role="user", content=args.prompt)
    else:
        request.text = args.prompt
    if args.max_tokens is not None:
        request.max_tokens = args.max_tokens
    request.sampling.temperature = args.temperature
    for field in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed"):  # fmt: skip
        if getattr(args, field) is not None:
            setattr(request.sampling, field, getattr(args, field))
    request.stopping.stop.extend(args.stop)
    request.stopping.ignore_eos = args.ignore_eos
    if args.n is not None:
        request.n = args.n
    if args.logprobs is not None:
        request.logprobs = args.logprobs
    if args.lora_name:
        request.lora_name = args.lora_name
    return request


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.client", description=__doc__)
    parser.add_argument("prompt", help="prompt text (or comma-separated ids with --token-ids)")
    parser.add_argument("--address", default="127.0.0.1:50051", help="gateway host:port")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--repetition-penalty", type=float)
    parser.add_argument("--presence-penalty", type=float)
    parser.add_argument("--frequency-penalty", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--n", type=int, help="number of samples")
    parser.add_argument("--logprobs", type=int, help="print each token's logprob to stderr")
    parser.add_argument("--token-ids", action="store_true", help="prompt is token ids")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    parser.add_argument("--system", help="system message (with --chat)")
    parser.add_argument("--lora-name", help="a LoRA adapter the server loaded (default: the base)")
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY") or None,
        help="bearer token for a gateway that requires one [env TANDEM_API_KEY]",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    streaming = (args.n or 1) == 1
    started = time.perf_counter()
    first_token_at = None
    last = None
    samples: dict[int, list[str]] = {}
    try:
        tls = tls_from_env()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    metadata = bearer_metadata(args.api_key)
    with open_sync_channel(args.address, tls) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        try:
            request = build_request(args)
            for response in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                if first_token_at is None and response.token_ids:
                    first_token_at = time.perf_counter()
                if streaming:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                samples.setdefault(response.index, []).append(response.text)
                for entry in response.logprobs:
                    print(f"  {entry.token!r}: {entry.logprob:.4f}", file=sys.stderr)
                last = response
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    elapsed = time.perf_counter() - started
    if streaming:
        sys.stdout.write("\n")
    else:
        for index in sorted(samples):
            sys.stdout.write(f"--- sample {index}\n{''.join(samples[index])}\n")
    if last is not None:
        usage = last.usage
        ttft = (first_token_at - started) if first_token_at else float("nan")
        finish = generate_pb2.FinishReason.Name(last.finish_reason)
        print(
            f"[{usage.completion_tokens} tokens, prompt {usage.prompt_tokens}, "
            f"{finish.removeprefix('FINISH_REASON_').lower()}, TTFT {ttft * 1e3:.1f} ms, "
            f"{usage.completion_tokens / elapsed:.1f} tok/s, request {last.request_id}]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
