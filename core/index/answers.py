"""What the prefix index answers per node (`NodeMatch`, best first)."""

from __future__ import annotations

from typing import NamedTuple


class NodeMatch(NamedTuple):
    """A tuple, not a dataclass: a lookup makes one per matching node, and
    `tuple.__new__(NodeMatch, fields)` makes it with no Python frame (a frozen
    dataclass's __init__ took 0.45 us a match, ~6% of an index round)."""

    node: str
    pages: int  # usable match length in pages on that node
    device: bool  # True if every page that match needs is on the node's DEVICE tier


def rank_key(m: NodeMatch) -> tuple[int, bool, str]:
    return -m.pages, not m.device, m.node
