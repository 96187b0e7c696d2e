"""Which attention implementation the model runs: the plain-torch paged reference (CPU,
and anywhere for checking) or the Triton kernels (CUDA). Chosen per worker by device and
overridable (`--attention-backend`); passed to the model explicitly, never a global.

Both write the step's K/V into the paged cache, then attend: the Triton backend uses the
decode kernel (split-KV) when every sequence has one new token — the shape CUDA graphs
capture — and the prefill/extend kernel otherwise.
"""

from __future__ import annotations

from typing import Protocol

import torch

from services.worker.models.attention_metadata import AttentionMetadata

BACKENDS = ("auto", "torch", "triton")


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


class TorchAttention:
    name = "torch"

    def __init__(self) -> None:
        from kernels import torch_paged

        self._impl = torch_paged

    def write_kv(self, key, value, k_cache, v_cache, meta):
        self._impl.reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)

    def attend(self, query, k_cache, v_cache, meta, scale):
        return self._impl.paged_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
        )


class TritonAttention:
    name = "triton"

    def __init__(self) -> None:
        # Imported on demand: defining Triton kernels is slow and CPU workers never need it.
        from kernels.paged_decode_attention import paged_decode_attention
        from kernels.paged_prefill_attention import paged_prefill_attention
        from kernels.reshape_and_cache import reshape_and_cache

        self._write = reshape_and_cache
        self._decode = paged_decode_attention
        self._prefill = paged_prefill_attention

    def write_kv(self, key, value, k_cache, v_cache, meta):
        self._write(key, value, k_cache, v_cache, meta.slot_mapping)

    def attend(self, query, k_cache, v_cache, meta, scale):
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
        )


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` is Triton on CUDA and torch elsewhere."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    return TritonAttention() if name == "triton" else TorchAttention()
