"""Deterministic K/V for tests: each token's K/V depends on its whole prefix, as
attention K/V do, without running a model."""

from __future__ import annotations

import torch
from kvfabric.core.cache.layout import KVLayout


def prefix_kv(layout: KVLayout, tokens: list[int]) -> list[torch.Tensor]:
    """Per-layer [2, T, kv_heads, head_dim] in the layout's dtype."""
    h, seeds = 17, []
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
        seeds.append(h)
    base = torch.tensor(seeds, dtype=torch.float64).reshape(1, len(tokens), 1, 1)
    grid = torch.arange(2 * layout.kv_heads * layout.head_dim, dtype=torch.float64)
    grid = grid.reshape(2, 1, layout.kv_heads, layout.head_dim)
    return [
        torch.sin(base * 1e-3 + grid * 0.37 + i * 1.7).to(layout.torch_dtype).contiguous()
        for i in range(len(layout.layers))
    ]
