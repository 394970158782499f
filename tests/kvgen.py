"""Deterministic K/V for tests: a token's K/V depends on its whole prefix, as in a model."""
from __future__ import annotations

import torch

from fabric import KVLayout


def prefix_kv(layout: KVLayout, tokens: list[int]) -> list[torch.Tensor]:
    n = len(tokens)
    h, seeds = 17, []
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
        seeds.append(h)
    base = torch.tensor(seeds, dtype=torch.float64).reshape(1, n, 1, 1)
    grid = torch.arange(2 * layout.kv_heads * layout.head_dim, dtype=torch.float64)
    grid = grid.reshape(2, 1, layout.kv_heads, layout.head_dim)
    out = []
    for layer in range(len(layout.layers)):
        vals = torch.sin(base * 1e-3 + grid * 0.37 + layer * 1.7)
        out.append(vals.to(layout.torch_dtype).contiguous())
    return out
