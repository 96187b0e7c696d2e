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
