"""Page positions along a path of run nodes: which node holds which position."""

from __future__ import annotations

from .layout import PoolName
from .radix import TreeNode


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
