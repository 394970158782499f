"""Which nodes an index takes events from, and from which epoch on.

Events travel on their own, late and out of order, so an index cannot tell from
them alone whether their sender still belongs. The directory decides: it drops a
node that died, and admits a node (a new one, or one restarted under its old
identity) with the epoch it now publishes under, before that node sends anything.
A dropped node stays refused, whatever its epoch, until it is admitted again;
events of an epoch below the admitted one are stale, wherever they come from.

A publisher whose life ended (an engine whose process is gone) is retired: its floor
moves past that life and the index frees its slot. Engines are named per life (the Serve
replica id), so retired names pile up: the floors of the newest MAX_RETIRED retired
names are kept, older ones forgotten. A retired life's late batch arrives within the
seconds a call takes, long before its name could be forgotten."""

from __future__ import annotations

from collections import OrderedDict
from enum import Enum

MAX_RETIRED = 1 << 16


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

    def __init__(self, max_retired: int = MAX_RETIRED) -> None:
        self._floor: dict[str, int] = {}
        self._dropped: set[str] = set()
        self._retired: OrderedDict[str, None] = OrderedDict()  # oldest first
        self._max_retired = max_retired

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

    def retire(self, node: str, epoch: int) -> int:
        """Life `epoch` of `node` ended: refuse it from now on (a later life is accepted);
        returns the floor now in force."""
        floor = self.admit(node, epoch + 1)
        self._retired[node] = None
        self._retired.move_to_end(node)
        while len(self._retired) > self._max_retired:
            old, _ = self._retired.popitem(last=False)
            self._floor.pop(old, None)
        return floor

    def alive(self, node: str) -> None:
        """`node` publishes again (a later life of a retired name): its floor is kept."""
        self._retired.pop(node, None)

    def __len__(self) -> int:
        """Names whose floor is kept."""
        return len(self._floor)

    def dropped(self) -> list[str]:
        return sorted(self._dropped)
