"""Device <-> host tier policy: write-through, write-through-selective,
write-back, and load-back of host-only pages before use."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

from .layout import PoolName, Tier
from .pools import PoolRegistry
from .radix import ABSENT, TreeNode
from .txn import ReservationFailed, Transaction


class WritePolicy(str, Enum):
    WRITE_THROUGH = "write_through"  # copy to host on insert
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # copy after N hits
    WRITE_BACK = "write_back"  # copy on device eviction


# Read once (enum member lookups are Python-level); TierConfig holds members, so `is` holds.
WRITE_THROUGH, WRITE_BACK = WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK


@dataclass(frozen=True)
class TierConfig:
    policy: WritePolicy = WritePolicy.WRITE_BACK
    selective_hits: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", WritePolicy(self.policy))
        if not isinstance(self.selective_hits, int) or self.selective_hits < 1:
            raise ValueError(f"selective_hits must be an int >= 1, got {self.selective_hits!r}")


class TierController:
    def __init__(
        self, registry: PoolRegistry, config: TierConfig, begin: Callable[[], Transaction]
    ) -> None:
        self.registry = registry
        self.config = config
        self._begin = begin
        self.backed_up = 0
        self.loaded_back = 0
        self.backup_failures = 0

    def write_back(self) -> bool:
        return self.config.policy is WRITE_BACK

    def after_insert(self, nodes: list[TreeNode]) -> None:
        if self.config.policy is WRITE_THROUGH:
            self.backup(nodes)

    def after_hit(self, nodes: list[TreeNode]) -> None:
        if self.config.policy == WritePolicy.WRITE_THROUGH_SELECTIVE:
            n = self.config.selective_hits
            self.backup([node for node in nodes if node.hits >= n])

    def backup(self, nodes: list[TreeNode]) -> bool:
        """Copy device pages lacking a host copy to host, whole or not at all."""
        todo = {}
        for pool in self.registry.names:
            if self.registry.pool(pool, Tier.HOST).capacity:
                groups = [(n, _lacking(n, pool, have=Tier.DEVICE, want=Tier.HOST)) for n in nodes]
                todo[pool] = [(n, offs) for n, offs in groups if offs]
        if not any(todo.values()):
            return True
        ok = self._move(todo, Tier.DEVICE, Tier.HOST)
        self.backed_up += ok * _size(todo)
        self.backup_failures += not ok
        return ok

    def load_back(self, needs: dict[PoolName, list[tuple[TreeNode, list[int]]]]) -> bool:
        """Give every (node, offsets) in `needs[pool]` a device copy of those pages."""
        todo = {}
        for pool, groups in needs.items():
            lacking = [
                (n, [j for j in offs if not n.page_has(j, pool, (Tier.DEVICE,))])
                for n, offs in groups
            ]
            todo[pool] = [(n, offs) for n, offs in lacking if offs]
        if not any(todo.values()):
            return True
        ok = self._move(todo, Tier.HOST, Tier.DEVICE)
        self.loaded_back += ok * _size(todo)
        return ok

    def _move(
        self, todo: dict[PoolName, list[tuple[TreeNode, list[int]]]], src: Tier, dst: Tier
    ) -> bool:
        txn = self._begin()
        try:
            try:
                got = txn.reserve_all({(p, dst): _size({p: groups}) for p, groups in todo.items()})
            except ReservationFailed:
                return False
            for pool, groups in todo.items():
                pages = iter(got[(pool, dst)])
                for node, offsets in groups:
                    # A page may have lost its source copy to eviction during the reservation.
                    source = node.slots[src][pool]
                    offsets = [j for j in offsets if source is not None and source[j] != ABSENT]
                    mine = [next(pages) for _ in offsets]
                    if source is not None and offsets:
                        txn.defer_copy(pool, src, [source[j] for j in offsets], dst, mine)
                        txn.place(node, dst, pool, offsets, mine)
            txn.commit()  # runs the copies: a failing one is undone with the rest
        finally:
            txn.rollback()  # a no-op once committed
        return True


def _lacking(node: TreeNode, pool: PoolName, have: Tier, want: Tier) -> list[int]:
    src, dst = node.slots[have][pool], node.slots[want][pool]
    if src is None:
        return []
    return [j for j, p in enumerate(src) if p != ABSENT and (dst is None or dst[j] == ABSENT)]


def _size(todo: dict[PoolName, list[tuple[TreeNode, list[int]]]]) -> int:
    return sum(len(offs) for groups in todo.values() for _, offs in groups)
