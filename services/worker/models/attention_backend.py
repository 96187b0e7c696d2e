"""Which attention implementation the model runs: the CPU path (a C++ decode kernel reading
the paged cache in place, torch's fused SDPA for prompts; the CPU default), the plain-torch
paged reference (for checking), or the Triton kernels (CUDA). Chosen per worker by device
and overridable (`--attention-backend`); passed to the model explicitly, never a global.

A backend plans each forward pass once (`prepare`, returning the metadata with its plan
attached), then each layer calls `forward`, which writes the step's K/V into the paged cache
and attends. The Triton backend uses the decode kernel (split-KV) when every sequence has
one new token — the shape CUDA graphs capture — and the prefill/extend kernel otherwise.

`forward` takes the layer's sliding window (None: full attention; see
`common.sliding_window`) and its score soft-cap (Gemma 2's `attn_logit_softcapping`:
scores become `softcap * tanh(scores / softcap)` before the softmax; None: none) and its
attention sinks (gpt-oss: one logit per query head whose exp joins each softmax's
denominator; None: none), which every backend's kernels honour.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from services.worker.models.attention_metadata import AttentionMetadata

BACKENDS = ("auto", "cpu", "torch", "triton")


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata: ...

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class CpuAttention:
    """`kernels/cpu_paged_attention.py`: one plan per pass, then per layer the C++ decode
    kernel and SDPA for prompt chunks."""

    name = "cpu"

    def __init__(self) -> None:
        from kernels import cpu_paged_attention

        self._impl = cpu_paged_attention

    def prepare(self, meta):
        if meta.backend_plan is not None:
            return meta
        plan = self._impl.plan(
            meta.slot_mapping,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_size,
        )
        return dataclasses.replace(meta, backend_plan=plan)

    def forward(
        self, query, key, value, k_cache, v_cache, meta, scale, window=None, softcap=None,
        sinks=None,
    ):  # fmt: skip
        plan = meta.backend_plan
        self._impl.write(key, value, k_cache, v_cache, plan)
        return self._impl.attend(
            query, key, value, k_cache, v_cache, plan, scale, window, softcap, sinks
        )

    def forward_qkv(
        self, qkv, num_heads, num_kv_heads, rope, k_cache, v_cache, meta, scale, window=None,
        softcap=None, sinks=None,
    ):  # fmt: skip
        """`forward` from the merged projection's output, rotating its queries and keys in
        the same C++ call as the write; None where that call does not apply."""
        plan = meta.backend_plan
        written = self._impl.rotate_and_write(
            qkv, num_heads, num_kv_heads, rope, k_cache, v_cache, plan
        )
        if written is None:
            return None
        query, key, value = written
        return self._impl.attend(
            query, key, value, k_cache, v_cache, plan, scale, window, softcap, sinks
        )


class TorchAttention:
    """`kernels/torch_paged.py`, the reference every other backend is tested against."""

    name = "torch"

    def __init__(self) -> None:
        from kernels import torch_paged

        self._impl = torch_paged

    def prepare(self, meta):
        return meta

    def forward(
        self, query, key, value, k_cache, v_cache, meta, scale, window=None, softcap=None,
        sinks=None,
    ):  # fmt: skip
        self._impl.reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        return self._impl.paged_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            window,
            softcap,
            sinks,
        )


class TritonAttention:
    """`kernels/reshape_and_cache.py`, then `paged_decode_attention.py` (pure-decode steps)
    or `paged_prefill_attention.py`. The caches go to the kernels as they are, an fp8
    (float8_e4m3fn) pool included: the write rounds to e4m3 like torch's cast and the
    attention kernels upcast its tiles in registers (any k/v scales are applied outside, by
    `Attention._scaled`)."""

    name = "triton"

    def __init__(self) -> None:
        # Imported on demand: defining Triton kernels is slow and CPU workers never need it.
        from kernels.paged_decode_attention import paged_decode_attention
        from kernels.paged_prefill_attention import paged_prefill_attention
        from kernels.reshape_and_cache import reshape_and_cache

        self._write = reshape_and_cache
        self._decode = paged_decode_attention
        self._prefill = paged_prefill_attention

    def prepare(self, meta):
        return meta

    def forward(
        self, query, key, value, k_cache, v_cache, meta, scale, window=None, softcap=None,
        sinks=None,
    ):  # fmt: skip
        self._write(key, value, k_cache, v_cache, meta.slot_mapping)
        if meta.is_pure_decode:
            return self._decode(
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens_t,
                scale,
                num_splits=meta.decode_num_splits,
                max_seq_len=meta.max_seq_len,
                window=window,
                softcap=softcap,
                sinks=sinks,
            )
        return self._prefill(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc_t,
            meta.seq_lens_t,
            scale,
            max_query_len=meta.max_query_len,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` is Triton on CUDA and the CPU path elsewhere."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    return {"cpu": CpuAttention, "torch": TorchAttention, "triton": TritonAttention}[name]()
