"""Counter-based noise for the sampler's exponential race.

A draw picks `argmax(probs / q)` over the candidate tokens with `q ~ Exp(1)` i.i.d. per
token, which selects token i with probability `probs[i]`; the sampler computes it as
`argmax(logits + g)` with `g = -log q` (Gumbel). Each `q` is a stateless hash of (row key,
output position, vocabulary index), so a seeded request (key = its seed) sees the same
noise at the same output position whatever else is in the batch, whichever worker runs the
step and however often the step is recomputed. Unseeded rows get a fresh random key per step
(`random_keys`).

Per row, (key, position) is hashed into an offset `a` and an odd multiplier `m`; token v's
noise is `mix32((a + m * v) mod 2**32)`, a SplitMix-style Weyl sequence through a 32-bit
avalanche hash. Everything is vectorised int64 torch arithmetic on values below 2**32 (both
hash multipliers are below 2**31), so no product leaves the int64 range. On CPU the same
integers come from one C++ pass (`kernels/cpu/seeded_uniform.cpp`, bit-identical) when the
CPU kernels are built.
"""

from __future__ import annotations

import torch

from kernels import cpu_ops

MASK32 = 0xFFFFFFFF
# hash-prospector's 32-bit avalanche hash [16 21f0aaad 15 735a2d97 15].
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97
_GOLDEN = 0x9E3779B9
# The range of `uniform` (so q = -log u lies in [-log U_MAX, -log U_MIN]).
U_MIN = 2.0**-24
U_MAX = 1.0 - 2.0**-24


def mix32_(x: torch.Tensor) -> torch.Tensor:
    """Hash int64 values in [0, 2**32) in place with a bijective 32-bit avalanche hash."""
    x.bitwise_xor_(x >> 16)
    x.mul_(_MUL1).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL2).bitwise_and_(MASK32)
    return x.bitwise_xor_(x >> 15)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """`mix32_` on a copy."""
    return mix32_(x.clone())


def split_key(key: int) -> tuple[int, int]:
    """A 64-bit key (e.g. a request seed) as its (low, high) 32-bit halves."""
    key %= 1 << 64
    return key & MASK32, key >> 32


def random_keys(
    num_rows: int, device: torch.device, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Fresh random 64-bit keys as int64 [num_rows, 2] (low, high) halves."""
    return torch.randint(
        0, 1 << 32, (num_rows, 2), generator=generator, device=device, dtype=torch.int64
    )


def row_streams(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 [R, 2] key halves and int64 [R] positions -> int64 [R, 2] (offset, odd
    multiplier) of each row's noise stream."""
    lo, hi = keys[:, 0], keys[:, 1]
    mixed = mix32_(hi ^ mix32_(positions & MASK32))
    offset = mix32_(lo ^ mixed)
    multiplier = mix32_(lo ^ mix32_(mixed ^ _GOLDEN)).bitwise_or_(1)
    return torch.stack((offset, multiplier), dim=1)


def uniform(streams: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float32 uniforms for every (row, token id): streams [R, 2], ids int64 [R or 1, C].

    23 random bits per value, as odd multiples of 2**-24 in [U_MIN, U_MAX]: exact in float32,
    never 0 or 1, and symmetric (u and 1 - u have the same distribution).
    """
    if streams.device.type == "cpu" and cpu_ops.available():
        return torch.ops.tandem_cpu.seeded_uniform(streams, token_ids)
    return uniform_reference(streams, token_ids)


def uniform_reference(streams: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """`uniform` in torch ops (any device); the C++ pass must equal it bit for bit."""
    x = token_ids * streams[:, 1:]
    x.add_(streams[:, :1]).bitwise_and_(MASK32)
    return mix32_(x).bitwise_right_shift_(8).bitwise_or_(1).float().mul_(2.0**-24)


def exponential(streams: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """q = -log(u) ~ Exp(1), finite and > 0, for every (row, token id)."""
    return uniform(streams, token_ids).log_().neg_()


def gumbel(streams: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """g = -log(q) with q = `exponential(...)`: argmax(logits + g) = argmax(probs / q)."""
    return exponential(streams, token_ids).log_().neg_()
