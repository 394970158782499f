"""Page positions along a path of run nodes: which node holds which position."""
from __future__ import annotations

from bisect import bisect_left
from typing import Iterator, Sequence

from .layout import PoolName, Tier
from .radix import ABSENT, Node


def missing_on_device(path: list[Node], positions: Sequence[int], m: int, pool: PoolName) -> list[int]:
    """Which of sorted `positions` lack a device page in `pool`: all from m on."""
    out: list[int] = []
    i = 0
    for node in path:
        j = bisect_left(positions, node.end, i)
        pages = node.slots[Tier.DEVICE][pool]
        if pages is None:
            out.extend(positions[i:j])
        elif ABSENT in pages:
            out.extend(p for p in positions[i:j] if pages[p - node.start] == ABSENT)
        i = j
    out.extend(positions[i:])    # past the path: new pages
    return out


def within(path: list[Node], spans: dict[PoolName, range]) -> dict[PoolName, list[Node]]:
    """Per pool, the nodes of `path` inside its span (span ends are node boundaries)."""
    return {p: [x for x in path if x.start < span.stop and x.end > span.start] for p, span in spans.items()}


def groups(path: list[Node], positions: range) -> list[tuple[Node, list[int]]]:
    """Positions of a range, as (node, offsets in its run) along `path`."""
    out = []
    for node in path:
        lo, hi = max(positions.start, node.start), min(positions.stop, node.end)
        if lo < hi:
            out.append((node, list(range(lo - node.start, hi - node.start))))
    return out


def by_node(nodes: list[Node], positions: Sequence[int],
            pages: Sequence[int]) -> Iterator[tuple[Node, list[int], Sequence[int]]]:
    """Split sorted `positions` and their `pages` by the node holding each position."""
    i = 0
    for node in nodes:
        j = bisect_left(positions, node.end, i)
        if j > i:
            start = node.start
            yield node, [p - start for p in positions[i:j]], pages[i:j]
        i = j
