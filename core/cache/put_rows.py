"""The K/V rows a put is given, and which pages they cover.

A caller may hold only part of a sequence's K/V for a pool: a request that
started from a cache hit has SWA rows only from its hit's window on. It says
where each pool's rows start instead of padding the rest, and a put stores
only the pages it has rows for. The rows come per layer (LayerKV), or already
page-shaped as the pools hold them (PagedKV: an engine's staging pages), which a
put copies into the pool in one pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from .layout import KVLayout, PoolName
from .page_bytes import LayerKV, copy_rows, pack, run_view


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
    pool's first page (the put's `starts`) on, [n, *layout.page_shape(pool)]: in rows
    0..n-1, or, with `rows`, the pool's page first + i in row rows[pool][i] (an engine's
    staging slots, read where they lie)."""

    pages: Mapping[PoolName, torch.Tensor]
    rows: Mapping[PoolName, Sequence[int]] | None = None

    def rows_of(self, pool: PoolName, rel: list[int]) -> list[int]:
        """The rows of `pool`'s tensor that hold the pages `rel` (counted from its first)."""
        if self.rows is None:
            return rel
        at = self.rows[pool]
        return [at[i] for i in rel]


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
    if kv.rows is not None and (
        not isinstance(kv.rows, Mapping) or set(kv.rows) != set(layout.pools)
    ):
        raise ValueError(f"paged kv rows must name the pools {[p.name for p in layout.pools]}")
    for pool, t in kv.pages.items():
        n = max(0, pages - first[pool])
        rows = None if kv.rows is None else kv.rows[pool]
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != layout.torch_dtype
            or t.shape[0] < (n if rows is None else 1)
            or tuple(t.shape[1:]) != tuple(layout.page_shape(pool))
        ):
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{pool.name} pages must be {layout.dtype} of shape [>={n}, "
                f"{', '.join(map(str, layout.page_shape(pool)))}], got {got}"
            )
        if rows is not None and not _rows_within(rows, n, t.shape[0]):
            raise ValueError(
                f"{pool.name} rows must be {n} or more ints in [0, {t.shape[0]}), got {rows!r:.80}"
            )


def _rows_within(rows: object, n: int, capacity: int) -> bool:
    """Whether `rows` names at least `n` rows, its first `n` ints in [0, capacity)."""
    if not isinstance(rows, Sequence) or len(rows) < n:
        return False
    head = rows[:n]
    if not all(isinstance(r, int) and not isinstance(r, bool) for r in head):
        return False
    return not head or (min(head) >= 0 and max(head) < capacity)


def write_rows(
    layout: KVLayout,
    pool: PoolName,
    kv: LayerKV | PagedKV,
    positions: list[int],
    first: int,
    dst: torch.Tensor,
    pages: list[int],
) -> None:
    """dst[pages[i]] = the page at sequence position positions[i] (all >= `first`), from
    rows that start at page `first`. Paged K/V in host memory goes straight from the
    caller's pages into the pool's in one pass (copy_rows: on a node's save from staging,
    index_copy_ of the gathered rows took 1.4-1.55x a memcpy of the bytes); otherwise
    the pages are packed (per-layer rows), or gathered where not one run, then scattered."""
    if positions and min(positions) < first:
        raise ValueError(
            f"{pool.name} page {min(positions)} lies before the rows given (page {first} on)"
        )
    rel = [p - first for p in positions]
    if isinstance(kv, PagedKV):
        src, at = kv.pages[pool], kv.rows_of(pool, rel)
        if src.device.type == "cpu" and dst.device.type == "cpu":
            copy_rows(src, at, dst, pages)
            return
        packed = run_view(src, at)
        if packed is None:
            packed = src.index_select(0, torch.tensor(at, dtype=torch.long, device=src.device))
    else:
        packed = pack(layout, pool, kv, rel)
    index = torch.tensor(pages, dtype=torch.long, device=dst.device)
    dst.index_copy_(0, index, packed.to(dst.device))
