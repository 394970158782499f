"""What the prefix index answers per node (`NodeMatch`, best first)."""

from __future__ import annotations

from typing import NamedTuple

from ..cache.layout import Tier


class NodeMatch(NamedTuple):
    """A tuple, not a dataclass: a lookup makes one per matching node, and
    `tuple.__new__(NodeMatch, fields)` makes it with no Python frame (a frozen
    dataclass's __init__ took 0.45 us a match, ~6% of an index round)."""

    node: str
    pages: int  # usable match length in pages on that node
    # The slowest tier a page that match needs lies on there: DEVICE when all are on the
    # node's device, HOST when all are in its memory, else DISK.
    tier: Tier


WireMatch = tuple[str, int, int]  # a NodeMatch as an index shard sends it: the tier's value


def rank_key(m: NodeMatch) -> tuple[int, int, str]:
    return -m.pages, m.tier, m.node
