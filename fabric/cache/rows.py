"""The K/V rows a put is given, and which pages they cover.

A caller may hold only part of a sequence's K/V for a pool: a request that
started from a cache hit has SWA rows only from its hit's window on. It says
where each pool's rows start instead of padding the rest, and a put stores
only the pages it has rows for."""

from __future__ import annotations

from typing import Mapping

import torch

from .layout import KVLayout, PoolName
from .pages import LayerKV, pack


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


def check_kv(layout: KVLayout, kv: LayerKV, pages: int, first: Mapping[PoolName, int]) -> None:
    """Each layer of pool p must hold rows for pages [first[p], pages): a
    [2, >= (pages - first[p]) * page_size, kv_heads, head_dim] tensor."""
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


def pack_rows(
    layout: KVLayout, pool: PoolName, kv: LayerKV, positions: list[int], first: int
) -> torch.Tensor:
    """Pages at sequence `positions` (all >= `first`) from rows that start at page `first`."""
    if positions and min(positions) < first:
        raise ValueError(
            f"{pool.name} page {min(positions)} lies before the rows given (page {first} on)"
        )
    return pack(layout, pool, kv, [p - first for p in positions])
