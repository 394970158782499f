"""What the prefix index answers per node (`NodeMatch`, best first), and the record it
keeps of one publication of consecutive pages (`Chain`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeMatch:
    node: str
    pages: int  # usable match length in pages on that node
    device: bool  # True if every page that match needs is on the node's DEVICE tier


def rank_key(m: NodeMatch) -> tuple[int, bool, str]:
    return -m.pages, not m.device, m.node


# What one publication said of a run of consecutive pages: (keys, first depth, parent of
# keys[0], mask). Every key of the run maps to the one record, so that storing a chain is a
# C-level dict update with no object per page; a page's parent and depth follow from its
# position. A record lives while any of its keys still maps to it.
Chain = tuple[tuple[bytes, ...], int, bytes, int]


def resolve(key: bytes, rec: Chain) -> tuple[bytes, int, int]:
    """(parent, depth, mask) of a key in its record: the last place it has there, as
    applying the pages in order would leave it."""
    keys, depth, parent, mask = rec
    if len(keys) == 1:
        return parent, depth, mask
    i = len(keys) - 1 - keys[::-1].index(key)
    return keys[i - 1] if i else parent, depth + i, mask
