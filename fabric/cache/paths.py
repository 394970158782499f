"""Page positions along a path of run nodes: which node holds which position."""

from __future__ import annotations

from bisect import bisect_left
from typing import Iterator, Sequence

from .layout import PoolName, Tier
from .radix import ABSENT, TreeNode


def missing(
    path: list[TreeNode],
    positions: Sequence[int],
    pool: PoolName,
    tiers: tuple[Tier, ...] = (Tier.DEVICE,),
) -> list[int]:
    """Which of sorted `positions` have a page in `pool` on none of `tiers`: all past the path."""
    out: list[int] = []
    i = 0
    for node in path:
        j = bisect_left(positions, node.end, i)
        if j > i:
            slots = [node.slots[t][pool] for t in tiers]
            if all(pages is None for pages in slots):
                out.extend(positions[i:j])
            elif not any(pages is not None and ABSENT not in pages for pages in slots):
                out.extend(
                    p for p in positions[i:j] if not node.page_has(p - node.start, pool, tiers)
                )
        i = j
    out.extend(positions[i:])  # past the path: new pages
    return out


def within(path: list[TreeNode], spans: dict[PoolName, range]) -> dict[PoolName, list[TreeNode]]:
    """Per pool, the nodes of `path` inside its span (span ends are node boundaries)."""
    return {
        p: [x for x in path if x.start < span.stop and x.end > span.start]
        for p, span in spans.items()
    }


def groups(path: list[TreeNode], positions: range) -> list[tuple[TreeNode, list[int]]]:
    """Positions of a range, as (node, offsets in its run) along `path`."""
    out = []
    for node in path:
        lo, hi = max(positions.start, node.start), min(positions.stop, node.end)
        if lo < hi:
            out.append((node, list(range(lo - node.start, hi - node.start))))
    return out


def by_node(
    nodes: list[TreeNode], positions: Sequence[int], pages: Sequence[int]
) -> Iterator[tuple[TreeNode, list[int], Sequence[int]]]:
    """Split sorted `positions` and their `pages` by the node holding each position."""
    i = 0
    for node in nodes:
        j = bisect_left(positions, node.end, i)
        if j > i:
            start = node.start
            yield node, [p - start for p in positions[i:j]], pages[i:j]
        i = j
