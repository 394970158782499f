"""Which nodes an index takes events from, and from which epoch on.

Events travel on their own, late and out of order, so an index cannot tell from
them alone whether their sender still belongs. The directory decides: it drops a
node that died, and admits a node (a new one, or one restarted under its old
identity) with the epoch it now publishes under, before that node sends anything.
A dropped node stays refused, whatever its epoch, until it is admitted again;
events of an epoch below the admitted one are stale, wherever they come from."""

from __future__ import annotations

from enum import Enum


class ApplyResult(str, Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    STALE_EPOCH = "stale_epoch"
    NEED_SNAPSHOT = "need_snapshot"
    DROPPED = "dropped"  # the directory dropped the node and has not admitted it again
    REJECTED = "rejected"  # not a valid message, or another layout's: nothing applied


class Admission:
    """Per node identity: dropped or not, and the lowest epoch still accepted. One int
    per identity ever admitted or dropped (identities are nodes, not requests)."""

    def __init__(self) -> None:
        self._floor: dict[str, int] = {}
        self._dropped: set[str] = set()

    def refuses(self, node: str, epoch: int) -> ApplyResult | None:
        """Why events of `node` at `epoch` are refused, or None if they are not."""
        if node in self._dropped:
            return ApplyResult.DROPPED
        if epoch < self._floor.get(node, 0):
            return ApplyResult.STALE_EPOCH
        return None

    def drop(self, node: str) -> None:
        self._dropped.add(node)

    def admit(self, node: str, epoch: int) -> int:
        """Accept `node` again, from `epoch` on (never lowering an earlier floor);
        returns the floor now in force."""
        self._dropped.discard(node)
        floor = self._floor[node] = max(self._floor.get(node, 0), epoch)
        return floor

    def dropped(self) -> list[str]:
        return sorted(self._dropped)
