"""What NodeCache's calls take and return: matches, locks, cached K/V, quarantines."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .layout import PoolName, Tier
from .page_bytes import unpack
from .radix import TreeNode


@dataclass(slots=True)  # one is made per request
class Match:
    """A request's cached prefix along `path` from the root: `present_pages` of it are in
    the tree, of which the first `usable_pages` can serve the request (every pool holds
    what a match of that length needs)."""

    path: list[TreeNode]  # nodes holding the request's matched pages (the last may hold more)
    present_pages: int  # pages present in the tree, on any tier, in any pool
    usable_pages: int  # usable length, either tier
    usable_device_pages: int  # usable length from the device tier alone
    request_pages: int  # whole pages in the request

    @property
    def keys(self) -> list[bytes]:
        return [k for n in self.path for k in n.keys][: self.usable_pages]


@dataclass
class PrefixLock:
    """A lock held outside the cache's own calls. It names pages by key and
    position, not by node: a later split of a locked run copies the lock into
    both halves, and unlocking finds both."""

    keys: list[bytes]
    spans: dict[PoolName, range]
    released: bool = False


@dataclass
class NodeGuard:
    """A lock held within one cache call, during which no run is split."""

    nodes: dict[PoolName, list[TreeNode]]


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
    `hold`: the id of the hold pinning this prefix until the caller's put
    (NodeCache.get with `hold_s`), 0 for none."""

    tokens: int
    starts: dict[PoolName, int]
    pages: dict[PoolName, torch.Tensor]
    pool_layers: dict[PoolName, tuple[int, ...]]
    n_layers: int
    host_tokens: int = 0
    hold: int = 0
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


@dataclass
class Quarantine:
    """Pages an abandoned transfer from `peer` may still write: held until that
    peer is known dead or a later read from it completes (never by time alone)."""

    since: float
    peer: str | None
    pages: dict[tuple[PoolName, Tier], list[int]]
