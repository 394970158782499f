"""CachedKV: the K/V of a cached prefix as NodeCache.get hands it out."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .layout import PoolName
from .page_bytes import unpack


@dataclass
class CachedKV:
    """K/V of a cached prefix. A pool's layers cover tokens [starts[pool], tokens): what
    its policy needs (full layers from 0, SWA layers the window before the end).
    `pages[pool]` holds them as gathered from the pool, [n, L, 2, page, kv_heads,
    head_dim] over the pool's layers (`pool_layers[pool]`, in order): a copy into
    page-shaped memory (staging) takes them as they are. `layers[i]` is layer i as
    [2, n_tokens, kv_heads, head_dim], unpacked at first use; a put of rows that start
    there passes `starts` on.
    A pool copied into the caller's memory (NodeCache.get's `into`) is in `sinks`
    instead: (that memory, its rows), page i in row i.
    `host_tokens`: how many of the tokens were loaded back from the host tier.
    `lease`: the id of the lease pinning this prefix until the caller's put
    (NodeCache.get with `lease_s`), 0 for none."""

    tokens: int
    starts: dict[PoolName, int]
    pages: dict[PoolName, torch.Tensor]
    pool_layers: dict[PoolName, tuple[int, ...]]
    n_layers: int
    host_tokens: int = 0
    lease: int = 0
    sinks: dict[PoolName, tuple[torch.Tensor, list[int]]] = field(default_factory=dict)

    @functools.cached_property
    def layers(self) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * self.n_layers
        pages = dict(self.pages)
        for pool, (data, rows) in self.sinks.items():
            pages[pool] = data.index_select(0, torch.tensor(rows, dtype=torch.long))
        for pool, held in pages.items():
            for li, t in zip(self.pool_layers[pool], unpack(held)):
                out[li] = t
        return out
