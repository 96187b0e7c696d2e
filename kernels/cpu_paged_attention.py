"""Paged attention on CPU: the C++ decode kernel and torch's fused SDPA for prompts.

Each forward pass is planned once (`plan`): which flat rows are single-token decodes and
which blocks they read, where each new token's K/V goes, and which prompt chunks start a
sequence (no cached prefix). Then every layer does:

- write: the step's K/V into their cache slots (one indexed store per cache), or, for a
  float32 model and cache, `rotate_and_write`: the rotary embedding of the merged q/k/v
  projection and the write in one C++ call (`kernels/cpu/rotary_write.cpp`);
- decodes, batched: `kernels/cpu/paged_decode_attention.cpp` reads their keys and values
  in place through the block tables (`torch.ops.tandem_cpu`); where that kernel could not
  be built, one `index_select` of their blocks per cache and one SDPA call with a padding
  mask instead;
- prompt chunks with no cached prefix: causal SDPA straight over the step's own K/V (the
  cache is not read);
- prompt chunks after a cached prefix: the context gathered from the cache, with a causal
  mask aligned to the chunk's end.

A layer with a sliding window W (`attend(..., window=W)`) lets the query at position p see
keys at p - W < k <= p, as Hugging Face does: the C++ kernel reads only the last W
positions, and the SDPA paths add the window to their masks (built once per pass and window,
`SdpaPlan.window_masks`, and only where the window is shorter than the context).

A layer with a score soft-cap c (Gemma 2's `attn_logit_softcapping`; `attend(...,
softcap=c)`) turns each score s into c * tanh(s / c) before the softmax: the C++ kernel
does it to its scores; SDPA cannot, so there the prompt chunks (and the fallback's decodes)
take `_capped`, Hugging Face's eager steps (scores, cap, mask, float32 softmax) in slices of
query rows.

A layer with attention sinks (gpt-oss; `attend(..., sinks=s)`, one logit per query head)
adds exp(s_h) to head h's softmax denominator: the C++ kernel adds it to its sum (and to the
maximum it subtracts); SDPA cannot, so the prompt chunks (and the fallback's decodes) take
`_capped` too, whose softmax then holds the sink column (`torch_paged.sink_softmax`).

On the SDPA paths masked positions get weight zero rather than being skipped, so every slot
of a referenced block must hold a finite value: the pool is zero-initialised and only ever
holds written K/V, so stale slots past a sequence's end are finite. Results match
`torch_paged` (the reference) to float rounding; scores and softmax run in float32 there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.torch_paged import sink_softmax


@dataclass(frozen=True)
class PromptChunk:
    """A sequence with more than one new token in this pass."""

    start: int  # first flat row
    q_len: int
    seq_len: int
    blocks: torch.Tensor | None  # int64 block ids of the context; None = no cached prefix
    mask: torch.Tensor | None  # bool [q_len, seq_len] (with a prefix only)


@dataclass(frozen=True)
class SdpaPlan:
    """What every layer of one forward pass reads and writes (built once per pass)."""

    write_blocks: torch.Tensor  # int64 [W]: block of each written token
    write_offsets: torch.Tensor  # int64 [W]: slot within the block
    write_rows: torch.Tensor | None  # int64 [W] rows of the written tokens; None = all rows
    decode_rows: torch.Tensor | None  # int64 [n]; None = every row is a decode, in order
    num_decodes: int
    decode_tables: torch.Tensor | None  # int64 [n, max_blocks] (rows contiguous)
    decode_lens: torch.Tensor | None  # int64 [n]
    decode_mask: torch.Tensor | None  # bool [n, 1, 1, max_blocks * block_size]; SDPA only
    prompts: tuple[PromptChunk, ...]
    use_kernel: bool = False  # decodes through the C++ kernel
    # window -> (decode mask, one mask per prompt chunk), built by `_window_masks` on first
    # use; None: the window does not bind there (the plain masks apply).
    window_masks: dict = field(default_factory=dict, compare=False, repr=False)


def plan(
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    block_size: int,
    use_kernel: bool | None = None,
) -> SdpaPlan:
    """The plan of one pass (host metadata; tensors on the caches' device). `use_kernel`:
    decodes through the C++ kernel (None: when it is available)."""
    if use_kernel is None:
        use_kernel = cpu_ops.available()
    device = slot_mapping.device
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    write_rows = None
    if not bool(keep.all()):
        write_rows = keep.nonzero().flatten()
        slots = slots[write_rows]
    q_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(seq_lens))]
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    tables = block_tables.to(device=device, dtype=torch.int64)
    decode_rows = decode_tables = decode_lens = decode_mask = None
    if decodes:
        decode_lens = torch.tensor([seq_lens[i] for i in decodes], device=device)
        max_blocks = -(-max(seq_lens[i] for i in decodes) // block_size)
        if len(decodes) == len(seq_lens):
            chosen = tables[:, :max_blocks]
        else:
            index = torch.tensor(decodes, device=device)
            chosen = tables[index, :max_blocks]
            decode_rows = torch.tensor([query_start_loc[i] for i in decodes], device=device)
        decode_tables = chosen.contiguous()
        if not use_kernel:
            positions = torch.arange(max_blocks * block_size, device=device)
            decode_mask = (positions[None, :] < decode_lens[:, None])[:, None, None, :]
    prompts = []
    for i, q_len in enumerate(q_lens):
        if q_len == 1:
            continue
        seq_len = seq_lens[i]
        if seq_len == q_len:
            prompts.append(PromptChunk(query_start_loc[i], q_len, seq_len, None, None))
            continue
        blocks = tables[i, : -(-seq_len // block_size)]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
        prompts.append(PromptChunk(query_start_loc[i], q_len, seq_len, blocks, mask))
    return SdpaPlan(
        write_blocks=torch.div(slots, block_size, rounding_mode="floor"),
        write_offsets=slots % block_size,
        write_rows=write_rows,
        decode_rows=decode_rows,
        num_decodes=len(decodes),
        decode_tables=decode_tables,
        decode_lens=decode_lens,
        decode_mask=decode_mask,
        prompts=tuple(prompts),
        use_kernel=use_kernel,
    )


def write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: SdpaPlan,
) -> None:
    """Store the step's K/V (`[T, kv_heads, head_dim]`) into the planned cache slots."""
    if plan.write_rows is not None:
        key, value = key[plan.write_rows], value[plan.write_rows]
    k_cache[plan.write_blocks, plan.write_offsets] = key.to(k_cache.dtype)
    v_cache[plan.write_blocks, plan.write_offsets] = value.to(v_cache.dtype)


def rotate_and_write(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: SdpaPlan,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The rotary embedding of the merged projection's queries and keys (`qkv` `[T, heads +
    2 kv_heads, head_dim]`, `rope` = (cos, sin) `[T, 1, head_dim // 2]`) and `write` of the
    rotated keys and the values, in one C++ call (`kernels/cpu/rotary_write.cpp`, the same
    arithmetic as `rope.rotate`). Returns (q, k, v), v a view of `qkv`; or None where the
    call does not apply (not float32 on CPU, a strided `qkv`, no compiled kernels): then
    rotate and write."""
    f32 = torch.float32
    if not (
        plan.use_kernel
        and qkv.dtype == f32
        and k_cache.dtype == f32
        and v_cache.dtype == f32
        and qkv.is_contiguous()
        and qkv.device.type == "cpu"
    ):
        return None
    # The kernel checks the rest (rope tables, a cache slot's heads contiguous): the
    # model's tables and the KV cache's layer views always are.
    q, k = torch.ops.tandem_cpu.rotary_write(
        qkv,
        *rope,
        num_heads,
        num_kv_heads,
        k_cache,
        v_cache,
        plan.write_blocks,
        plan.write_offsets,
        plan.write_rows,
    )
    return q, k, qkv[:, num_heads + num_kv_heads :]


_CAPPED_ROWS = 256  # query rows per slice of `_capped` scores (~L KiB per row and head)


def _sdpa(q, k, v, scale, mask=None, causal=False, softcap=None, sinks=None):
    """q [Q, H, D], k/v [L, KV, D] -> [Q, H, D] (grouped-query heads, float32 math).
    Inputs go in as 4-d [1, heads, len, D]: only then does torch pick its fused CPU kernel
    (3-d inputs fall back to the unfused math path, ~8x slower on a 2k-token prompt).
    `softcap` / `sinks`: soft-capped scores or attention sinks through `_capped` instead
    (`causal`: aligned to the end)."""
    if softcap is not None or sinks is not None:
        if causal:
            k_pos = torch.arange(k.shape[0], device=q.device)
            mask = k_pos[None, :] <= k_pos[-q.shape[0] :, None]
        return _capped_rows(q, k, v, scale, softcap, mask, sinks)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).float(),
        k.transpose(0, 1).unsqueeze(0).float(),
        v.transpose(0, 1).unsqueeze(0).float(),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _capped_rows(q, k, v, scale, softcap, mask, sinks=None):
    """`_capped` of q [Q, H, D] over k/v [L, KV, D] (`mask` [Q, L] or None), in slices of
    `_CAPPED_ROWS` query rows -> float32 [Q, H, D]."""
    k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for first in range(0, q.shape[0], _CAPPED_ROWS):
        rows = slice(first, first + _CAPPED_ROWS)
        part = None if mask is None else mask[rows][None, None]
        q4 = q[rows].transpose(0, 1).unsqueeze(0)
        out[rows] = _capped(q4, k4, v4, scale, softcap, part, sinks)[0].transpose(0, 1)
    return out


def _capped(q, k, v, scale, softcap, mask=None, sinks=None):
    """Soft-capped attention, or attention with sinks (`sinks` float32 [H]; `softcap` None:
    no cap), in Hugging Face's eager steps: q [B, H, Q, D], k/v [B, KV, L, D] (grouped-query
    heads, not copied), `mask` bool broadcastable to [B, 1, Q, L] (True: visible) -> float32
    [B, H, Q, D]."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.float().reshape(batch, kv_heads, heads // kv_heads, q_len, head_dim)
    scores = grouped @ k.float().unsqueeze(2).transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    per_head = None if sinks is None else sinks.float().view(1, kv_heads, -1, 1, 1)
    out = sink_softmax(scores, per_head) @ v.float().unsqueeze(2)
    return out.reshape(batch, heads, q_len, head_dim)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: SdpaPlan,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the pass's queries `[T, q_heads, head_dim]` (after `write`), given the
    step's own keys and values `[T, kv_heads, head_dim]`; returns `[T, q_heads, head_dim]`.
    `window`: the layer's sliding window (None: full causal attention); `softcap`: the
    scores' tanh cap (None: none); `sinks`: one sink logit per query head (None: none)."""
    num_tokens, _, head_dim = query.shape
    num_kv = k_cache.shape[2]
    if sinks is not None:
        sinks = sinks.float().contiguous()
    decode_mask, prompt_masks = plan.decode_mask, (None,) * len(plan.prompts)
    if window is not None:
        decode_mask, prompt_masks = _window_masks(plan, window)
    if plan.num_decodes == num_tokens and not plan.prompts:
        return _decode(query, k_cache, v_cache, plan, scale, window, decode_mask, softcap, sinks)
    out = torch.empty_like(query)
    if plan.num_decodes:
        rows = plan.decode_rows
        out[rows] = _decode(
            query[rows], k_cache, v_cache, plan, scale, window, decode_mask, softcap, sinks
        )
    for chunk, windowed in zip(plan.prompts, prompt_masks, strict=True):
        rows = slice(chunk.start, chunk.start + chunk.q_len)
        if chunk.blocks is None:
            k, v = key[rows], value[rows]
            if windowed is None:
                result = _sdpa(query[rows], k, v, scale, causal=True, softcap=softcap, sinks=sinks)
            else:
                result = _sdpa(
                    query[rows], k, v, scale, mask=windowed, softcap=softcap, sinks=sinks
                )
        else:
            k = k_cache.index_select(0, chunk.blocks).view(-1, num_kv, head_dim)
            v = v_cache.index_select(0, chunk.blocks).view(-1, num_kv, head_dim)
            length = chunk.seq_len
            mask = chunk.mask if windowed is None else windowed
            result = _sdpa(
                query[rows], k[:length], v[:length], scale, mask=mask, softcap=softcap, sinks=sinks
            )
        out[rows] = result.to(query.dtype)
    return out


def _window_masks(plan: SdpaPlan, window: int):
    """The plan's masks narrowed to a sliding window (cached on the plan per window): the
    SDPA decode mask (None where the C++ kernel decodes or no decode's context exceeds the
    window) and one mask per prompt chunk (None where its context fits the window)."""
    cached = plan.window_masks.get(window)
    if cached is not None:
        return cached
    decode_mask = plan.decode_mask
    if decode_mask is not None:
        positions = torch.arange(decode_mask.shape[-1], device=decode_mask.device)
        inside = positions[None, :] >= (plan.decode_lens[:, None] - window)
        decode_mask = decode_mask & inside[:, None, None, :]
    prompt_masks = []
    for chunk in plan.prompts:
        if chunk.seq_len <= window:
            prompt_masks.append(None)
            continue
        device = plan.write_blocks.device
        q_pos = torch.arange(chunk.seq_len - chunk.q_len, chunk.seq_len, device=device)
        # Keys: the chunk's own (no cached prefix) or the whole context.
        first_key = chunk.seq_len - chunk.q_len if chunk.blocks is None else 0
        k_pos = torch.arange(first_key, chunk.seq_len, device=device)
        diff = q_pos[:, None] - k_pos[None, :]
        prompt_masks.append((diff >= 0) & (diff < window))
    cached = (decode_mask, tuple(prompt_masks))
    plan.window_masks[window] = cached
    return cached


def _decode(
    query, k_cache, v_cache, plan: SdpaPlan, scale, window=None, mask=None, softcap=None,
    sinks=None,
):  # fmt: skip
    """The plan's decodes; `mask`: the SDPA fallback's (None: `plan.decode_mask`)."""
    if plan.use_kernel:
        q = query.float().contiguous()
        out = torch.empty_like(q)
        torch.ops.tandem_cpu.paged_decode_attention(
            out, q, k_cache, v_cache, plan.decode_tables, plan.decode_lens, scale, window or 0,
            softcap or 0.0, sinks,
        )  # fmt: skip
        return out.to(query.dtype)
    n = plan.num_decodes
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    blocks = plan.decode_tables.view(-1)
    keys = k_cache.index_select(0, blocks).view(n, -1, num_kv, head_dim)
    values = v_cache.index_select(0, blocks).view(n, -1, num_kv, head_dim)
    if softcap is not None or sinks is not None:
        out = _capped(
            query.view(n, -1, 1, head_dim), keys.transpose(1, 2), values.transpose(1, 2),
            scale, softcap, plan.decode_mask if mask is None else mask, sinks,
        )  # fmt: skip
        return out.view(n, -1, head_dim).to(query.dtype)
    out = F.scaled_dot_product_attention(
        query.view(n, -1, 1, head_dim).float(),
        keys.transpose(1, 2).float(),
        values.transpose(1, 2).float(),
        attn_mask=plan.decode_mask if mask is None else mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.view(n, -1, head_dim).to(query.dtype)
