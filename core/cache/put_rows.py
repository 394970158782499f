"""The K/V rows a put is given, and which pages they cover.

A caller may hold only part of a sequence's K/V for a pool: a request that
started from a cache hit has SWA rows only from its hit's window on. It says
where each pool's rows start instead of padding the rest, and a put stores
only the pages it has rows for. The rows come per layer (LayerKV), or already
page-shaped as the pools hold them (PagedKV: an engine's staging pages), which a
put copies into the pool in one pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from .layout import KVLayout, PoolName
from .page_bytes import LayerKV, pack, run_view


def first_pages(layout: KVLayout, starts: Mapping[PoolName, int] | None) -> dict[PoolName, int]:
    """Per pool of `layout`, the first page the caller has rows for (pools not
    in `starts` start at 0). Raises ValueError for a start that is not a whole
    number of pages, or a pool the layout lacks."""
    first = dict.fromkeys(layout.pools, 0)
    for pool, start in (starts or {}).items():
        if pool not in first:
            raise ValueError(
                f"rows given for pool {pool!r}, the layout has {[p.name for p in layout.pools]}"
            )
        if (
            not isinstance(start, int)
            or isinstance(start, bool)
            or start < 0
            or start % layout.page_size
        ):
            raise ValueError(
                f"{PoolName(pool).name} rows must start at a whole page >= 0, got {start!r}"
            )
        first[PoolName(pool)] = start // layout.page_size
    return first


@dataclass(frozen=True)
class PagedKV:
    """K/V in the pools' page shape: `pages[pool]` holds the sequence's pages from the
    pool's first page (the put's `starts`) on, [n, *layout.page_shape(pool)]."""

    pages: Mapping[PoolName, torch.Tensor]


def check_kv(
    layout: KVLayout, kv: LayerKV | PagedKV, pages: int, first: Mapping[PoolName, int]
) -> None:
    """Each layer of pool p must hold rows for pages [first[p], pages): a
    [2, >= (pages - first[p]) * page_size, kv_heads, head_dim] tensor (paged: pool p's
    tensor [>= pages - first[p], *page_shape(p)])."""
    if isinstance(kv, PagedKV):
        _check_paged(layout, kv, pages, first)
        return
    if len(kv) != len(layout.layers):
        raise ValueError(f"kv has {len(kv)} layers, layout has {len(layout.layers)}")
    for pool in layout.pools:
        rows = max(0, pages - first[pool]) * layout.page_size
        for i in layout.layers_of(pool):
            t = kv[i]
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != layout.torch_dtype
                or t.dim() != 4
                or t.shape[0] != 2
                or t.shape[1] < rows
                or tuple(t.shape[2:]) != (layout.kv_heads, layout.head_dim)
            ):
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"kv[{i}] must be {layout.dtype} of shape [2, >={rows}, "
                    f"{layout.kv_heads}, {layout.head_dim}], got {got}"
                )


def _check_paged(layout: KVLayout, kv: PagedKV, pages: int, first: Mapping[PoolName, int]) -> None:
    if not isinstance(kv.pages, Mapping) or set(kv.pages) != set(layout.pools):
        raise ValueError(f"paged kv must hold the pools {[p.name for p in layout.pools]}")
    for pool, t in kv.pages.items():
        n = max(0, pages - first[pool])
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != layout.torch_dtype
            or t.shape[0] < n
            or tuple(t.shape[1:]) != tuple(layout.page_shape(pool))
        ):
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{pool.name} pages must be {layout.dtype} of shape [>={n}, "
                f"{', '.join(map(str, layout.page_shape(pool)))}], got {got}"
            )


def pack_rows(
    layout: KVLayout, pool: PoolName, kv: LayerKV | PagedKV, positions: list[int], first: int
) -> torch.Tensor:
    """Pages at sequence `positions` (all >= `first`) from rows that start at page `first`
    (paged: a view where the positions are one run, else one gather)."""
    if positions and min(positions) < first:
        raise ValueError(
            f"{pool.name} page {min(positions)} lies before the rows given (page {first} on)"
        )
    rel = [p - first for p in positions]
    if not isinstance(kv, PagedKV):
        return pack(layout, pool, kv, rel)
    src = kv.pages[pool]
    view = run_view(src, rel)
    if view is not None:
        return view
    return src.index_select(0, torch.tensor(rel, dtype=torch.long, device=src.device))
