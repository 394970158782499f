"""What the prefix index answers per node (`NodeMatch`, best first)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeMatch:
    node: str
    pages: int  # usable match length in pages on that node
    device: bool  # True if every page that match needs is on the node's DEVICE tier


def rank_key(m: NodeMatch) -> tuple[int, bool, str]:
    return -m.pages, not m.device, m.node
