"""The fewest bytes that hold a float32 weight exactly, for Tandem's packed CPU products
(`kernels/cpu/packed_linear.cpp`): GGUF Q4_1 blocks (5 bits a value), Q8_0 blocks (8.5),
bfloat16 (16), else float32 panels.

A checkpoint made from a GGUF file (`common/gguf_checkpoint.py`) holds float32 values that
are exactly `d * q + m` (Q4_1) or `d * q` (Q8_0) over blocks of 32 values along a row, with
float16 `d` and `m`. A bf16 checkpoint read into float32 holds bfloat16 values. Finding the
form back from the values (`q4_1_blocks`, `q8_0_blocks`) needs no GGUF mapping, survives
merging q/k/v and permuting rows, and is checked value by value: a weight is kept in a
compact form only when every one of its values comes back bit for bit, so the products are
the float32 panels' exactly. Decode steps stream every weight once per step, so they read
2-6x fewer bytes.

Where they pay: bfloat16 panels at every row count (widened in registers: SmolLM2's shapes,
1 row 11.8 -> 6.4 ms, 16 rows 13.5 -> 11.4, 32 and 128 equal). Block panels dequantize a
chunk into L1 before the rows multiply it, which costs more than it saves past a few dozen
rows (SmolLM2's Q4_1 weights, the 30 layers and head: 1-4 rows 11-12 -> 6-6.5 ms, 6 rows
10.0 -> 7.8, 8 rows 9.9 -> 8.4, 12 rows about equal, 16 rows 4% faster in one run and 4%
slower in another, 32 rows 8% slower, 128 rows 10% slower; served at c16, taking them up to
16 rows read 2.5% slower than without), so a layer keeps them beside its float panels and
uses them up to `BLOCK_PANEL_ROWS` rows.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values along k per quantization block
BLOCK_PANEL_ROWS = 8  # products of up to this many rows take the block panels
PANEL = 16  # output columns per panel
Q4_BYTES = 32 + 32 + BLOCK * 8
Q8_BYTES = 32 + BLOCK * 16


def q4_1_blocks(weight_t: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """`[K, N]` float32 -> float16 `d`, `m` `[K/32, N]` and uint8 `q` `[K/32, 32, N]` (0..15)
    with `d * q + m == weight_t` exactly, or None when no such blocks give every value."""
    k, n = weight_t.shape
    if k % BLOCK or weight_t.dtype != torch.float32:
        return None
    v = weight_t.reshape(k // BLOCK, BLOCK, n)
    m = v.amin(1)
    if not torch.equal(m.half().float(), m):
        return None
    span = v.amax(1) - m
    guess = (span / 15).half()
    bits = guess.view(torch.int16)
    found = torch.zeros_like(m, dtype=torch.bool)
    d_best = torch.zeros_like(m)
    q_best = torch.zeros_like(v, dtype=torch.uint8)
    # float16 rounding of d may leave the max off by an ulp or two of d: try the neighbours
    for step in (0, -1, 1, -2, 2):
        d = (bits + step).view(torch.float16).float().clamp(min=0)
        d = torch.where(span == 0, torch.zeros_like(d), d)
        if not torch.isfinite(d).all():
            continue
        safe = torch.where(d == 0, torch.ones_like(d), d)
        q = ((v - m[:, None]) / safe[:, None]).round().clamp(0, 15)
        q = torch.where((d == 0)[:, None], torch.zeros_like(q), q)
        ok = ((d[:, None] * q + m[:, None]) == v).all(1) & ~found
        d_best = torch.where(ok, d, d_best)
        q_best = torch.where(ok[:, None], q.to(torch.uint8), q_best)
        found |= ok
        if bool(found.all()):
            return d_best.half(), m.half(), q_best
    return None


def q8_0_blocks(weight_t: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """`[K, N]` float32 -> float16 `d` `[K/32, N]` and int8 `q` `[K/32, 32, N]` with
    `d * q == weight_t` exactly, or None."""
    k, n = weight_t.shape
    if k % BLOCK or weight_t.dtype != torch.float32:
        return None
    v = weight_t.reshape(k // BLOCK, BLOCK, n)
    d = v.abs().amax(1) / 127
    if not torch.equal(d.half().float(), d):
        return None
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = (v / safe[:, None]).round().clamp(-128, 127)
    if not torch.equal(d[:, None] * q, v):
        return None
    return d.half(), q.to(torch.int8)


def _panels(t: torch.Tensor, n: int) -> torch.Tensor:
    """`[..., N]` -> `[P, ..., 16]`, N zero-padded to whole panels."""
    pad = -n % PANEL
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    t = t.reshape(*t.shape[:-1], -1, PANEL)
    return t.movedim(-2, 0).contiguous()


def pack_q4_1(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Blocks -> uint8 `[P, K/32, 320]`: per block d float16[16], m float16[16], then 16
    pairs of rows, 16 bytes each (byte j: column j of the pair's first row in the low
    nibble, of its second row in the high one)."""
    n = d.shape[-1]
    dp = _panels(d, n).view(torch.uint8)  # [P, K/32, 32]
    mp = _panels(m, n).view(torch.uint8)
    qp = _panels(q, n)  # [P, K/32, 32, 16]
    pairs = qp.reshape(*qp.shape[:2], BLOCK // 2, 2, PANEL)
    nibbles = pairs[..., 0, :] | (pairs[..., 1, :] << 4)  # [P, K/32, 16, 16]
    return torch.cat([dp, mp, nibbles.flatten(-2)], dim=-1).contiguous()


def pack_q8_0(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Blocks -> uint8 `[P, K/32, 544]`: per block d float16[16], then 32 rows of 16 int8."""
    n = d.shape[-1]
    dp = _panels(d, n).view(torch.uint8)
    qp = _panels(q, n).view(torch.uint8).flatten(-2)  # [P, K/32, 512]
    return torch.cat([dp, qp], dim=-1).contiguous()


def block_panels(weight_t: torch.Tensor) -> torch.Tensor | None:
    """The weight as Q4_1 (preferred) or Q8_0 block panels when its values are exactly
    such blocks' (uint8 `[P, K/32, 320 or 544]`), else None."""
    blocks = q4_1_blocks(weight_t)
    if blocks is not None:
        return pack_q4_1(*blocks)
    blocks = q8_0_blocks(weight_t)
    return None if blocks is None else pack_q8_0(*blocks)


def narrowest_float(weight_t: torch.Tensor) -> torch.Tensor:
    """The weight as bfloat16 when every value is one (a bf16 checkpoint read into float32),
    else as it is: what `pack_linear_weight` cuts into float panels."""
    if weight_t.dtype != torch.float32:
        return weight_t
    narrow = weight_t.to(torch.bfloat16)
    return narrow if torch.equal(narrow.float(), weight_t) else weight_t
