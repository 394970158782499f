"""Entries of an index shard per region, for splits by size as well as by lookups.

A key's region is the one a lookup ending at it would go to (`RouteTable.locate`):
the deepest route on its path (a spread route's child is a region of its own),
else its first page. A shard knows each key's parent and depth, so regions are
found by walking parent links, each key once (memoized), with no paths stored.
"""

from __future__ import annotations

from .prefix_index import PrefixIndex
from .region_hits import RegionHits, Regions, prune_regions
from .routes import RouteTable

# (region root, child of the root on the key's path, or None for the root itself)
_Place = tuple[bytes, "bytes | None"]


def entries_by_region(index: PrefixIndex, routes: RouteTable) -> Regions:
    """Region root -> its entries, per child one level down (the most held children
    and the most held regions only, as `kvfabric.core.index.balance` keeps lookups)."""
    by_key = {r.key: r for r in routes.routes}
    memo: dict[bytes, _Place] = {}
    out: Regions = {}
    for key in index.held_keys():
        root, child = _place(index, by_key, memo, key)
        region = out.get(root)
        if region is None:
            region = out[root] = RegionHits(_path(index, root))
        if child is not None:
            region.children[child] += 1  # pruned once, below: the pass is bounded anyway
            region.total += 1
    prune_regions(out)
    return out


def _place(index: PrefixIndex, by_key: dict, memo: dict[bytes, _Place], key: bytes) -> _Place:
    chain = []  # keys walked up from `key`, nearest first
    k, found = key, None
    while True:
        if k in memo:
            found = memo[k]
            break
        meta = index.page_meta(k)
        route = by_key.get(k)
        if meta is None or meta[1] == 0 or route is not None:
            found = (k, None)  # a route's root, a first page, or the top of what is held
            memo[k] = found
            break
        parent_route = by_key.get(meta[0])
        if parent_route is not None and parent_route.spread:
            found = (k, None)  # a spread route's child is a region of its own
            memo[k] = found
            break
        chain.append(k)
        k = meta[0]
    # Unwind: a walked key is in its parent's region; below the root it is the child itself.
    for k in reversed(chain):
        root, child = found
        found = memo[k] = (root, child if child is not None else k)
    return memo[key]


def _path(index: PrefixIndex, root: bytes) -> tuple[bytes, ...]:
    """The key path from depth 0 to `root`, as far as this shard holds it."""
    path = [root]
    meta = index.page_meta(root)
    while meta is not None and meta[1] > 0:
        path.append(meta[0])
        meta = index.page_meta(meta[0])
    return tuple(reversed(path))
