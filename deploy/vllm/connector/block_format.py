"""Where K and V sit inside a vLLM attention backend's KV tensor, as one view to copy through.

vLLM hands a connector each layer's cache as the logical [blocks, kv_heads, block_size,
2 * head_dim] view; its physical order follows the engine's KVCacheLayout, so strides
vary, but the last dim is always innermost. Backends split that last pair differently:
CPU_ATTN reads each (block, head) slab as block_size K rows then block_size V rows, while
the CUDA backends split each token's row, K = [:head_dim] and V = [head_dim:]. Either way
the worker copies through one view, [blocks, kv_heads, 2, block_size, head_dim], so a
fabric page means the same K and V whichever backend wrote it.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable

import torch


class BlockFormatError(ValueError):
    """The engine's attention backend or KV tensor is one this connector cannot convert."""


class BlockFormat(Enum):
    KV_ROWS = "kv-rows"  # per (block, head): K rows, then V rows
    KV_CHANNELS = "kv-channels"  # per token: K channels, then V channels

    @classmethod
    def of_backends(cls, names: Iterable[str]) -> "BlockFormat":
        """The one format of every attention backend the engine's layers use."""
        formats = set()
        for name in set(names):
            if name not in BACKEND_FORMATS:
                raise BlockFormatError(
                    f"attention backend {name!r}: the fabric converts "
                    f"{sorted(BACKEND_FORMATS)} only"
                )
            formats.add(BACKEND_FORMATS[name])
        if len(formats) != 1:
            raise BlockFormatError(
                f"the engine's layers need one KV format, got {sorted(f.value for f in formats)}"
            )
        return formats.pop()

    def view(self, t: torch.Tensor, kv_heads: int, block_size: int, head_dim: int) -> torch.Tensor:
        """`t` (one layer's KV tensor) as [blocks, kv_heads, 2, block_size, head_dim],
        sharing its storage; a RuntimeError if its shape or strides do not allow it."""
        want = (kv_heads, block_size, 2 * head_dim)
        if t.dim() != 4 or tuple(t.shape[1:]) != want or t.stride(3) != 1:
            raise RuntimeError(
                f"KV tensor {tuple(t.shape)} strides {t.stride()} is not "
                f"[blocks, {kv_heads}, {block_size}, {2 * head_dim}] with the "
                "content dim innermost"
            )
        blocks, heads, rows, _ = t.shape
        s_block, s_head, s_row, _ = t.stride()
        if self is BlockFormat.KV_ROWS:
            # K rows then V rows only mean something when a slab's rows follow each other.
            if s_row != 2 * head_dim:
                raise RuntimeError(
                    f"KV tensor strides {t.stride()}: CPU_ATTN's (block, head) "
                    "slab must be contiguous"
                )
            return t.as_strided(
                (blocks, heads, 2, rows, head_dim),
                (s_block, s_head, rows * head_dim, head_dim, 1),
                t.storage_offset(),
            )
        return t.as_strided(
            (blocks, heads, 2, rows, head_dim),
            (s_block, s_head, head_dim, s_row, 1),
            t.storage_offset(),
        )


# vLLM's backend names (AttentionBackend.get_name()) for unquantized K/V.
BACKEND_FORMATS = {
    "CPU_ATTN": BlockFormat.KV_ROWS,
    "FLASH_ATTN": BlockFormat.KV_CHANNELS,
    "FLASHINFER": BlockFormat.KV_CHANNELS,
    "TRITON_ATTN": BlockFormat.KV_CHANNELS,
    "FLEX_ATTENTION": BlockFormat.KV_CHANNELS,
}
