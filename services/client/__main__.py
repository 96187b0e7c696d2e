"""`python -m services.client "prompt"`: stream a completion from the gateway to the terminal.

Text goes to stdout as it arrives; a summary (tokens, finish reason, time to first token,
tokens/s) goes to stderr. Exit status 1 with the gRPC status on failure.
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc


def build_request(args: argparse.Namespace) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest()
    if args.token_ids:
        request.token_ids.ids.extend(int(t) for t in args.prompt.split(","))
    else:
        request.text = args.prompt
    if args.max_tokens is not None:
        request.max_tokens = args.max_tokens
    request.sampling.temperature = args.temperature
    if args.top_p is not None:
        request.sampling.top_p = args.top_p
    if args.top_k is not None:
        request.sampling.top_k = args.top_k
    return request


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.client", description=__doc__)
    parser.add_argument("prompt", help="prompt text (or comma-separated ids with --token-ids)")
    parser.add_argument("--address", default="127.0.0.1:50051", help="gateway host:port")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--token-ids", action="store_true", help="prompt is token ids")
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    first_token_at = None
    last = None
    with grpc.insecure_channel(args.address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        try:
            for response in stub.Generate(build_request(args), timeout=args.timeout):
                if first_token_at is None and response.token_ids:
                    first_token_at = time.perf_counter()
                sys.stdout.write(response.text)
                sys.stdout.flush()
                last = response
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    elapsed = time.perf_counter() - started
    sys.stdout.write("\n")
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
