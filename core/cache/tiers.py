"""Tier policy: device pages to host by write-through, write-through-selective or
write-back; host pages to disk as they are evicted (where the pool has a disk tier); and
load-back to device, from the nearest tier holding each page, before use."""

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
        self,
        registry: PoolRegistry,
        config: TierConfig,
        begin: Callable[[], Transaction],
    ) -> None:
        self.registry = registry
        self.config = config
        self._begin = begin
        self.backed_up = 0
        self.loaded_back = 0
        self.backup_failures = 0

    def write_back(self, pool: PoolName, tier: Tier) -> bool:
        """Whether `pool`'s pages evicted from `tier` go to the tier below it."""
        if tier is Tier.DEVICE:
            return self.config.policy is WRITE_BACK
        return tier is Tier.HOST and self.registry.pool(pool, Tier.DISK).capacity > 0

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
        ok = self._move(todo, (Tier.DEVICE,), Tier.HOST)
        self.backed_up += ok * _size(todo)
        self.backup_failures += not ok
        return ok

    def load_back(
        self,
        needs: dict[PoolName, list[tuple[TreeNode, list[int]]]],
        tiers: tuple[Tier, ...] = (Tier.DEVICE,),
    ) -> bool:
        """Give every (node, offsets) in `needs[pool]` a copy of those pages on one of
        `tiers`: where none has one, a device copy, from the nearest tier holding it."""
        todo = {}
        for pool, groups in needs.items():
            lacking = [
                (n, [j for j in offs if not n.page_has(j, pool, tiers)]) for n, offs in groups
            ]
            todo[pool] = [(n, offs) for n, offs in lacking if offs]
        if not any(todo.values()):
            return True
        ok = self._move(todo, (Tier.HOST, Tier.DISK), Tier.DEVICE)
        self.loaded_back += ok * _size(todo)
        return ok

    def _move(
        self,
        todo: dict[PoolName, list[tuple[TreeNode, list[int]]]],
        sources: tuple[Tier, ...],
        dst: Tier,
    ) -> bool:
        """Copy each page of `todo` to `dst` from the first of `sources` holding it."""
        txn = self._begin()
        try:
            try:
                got = txn.reserve_all({(p, dst): _size({p: groups}) for p, groups in todo.items()})
            except ReservationFailed:
                return False
            for pool, groups in todo.items():
                pages = iter(got[(pool, dst)])
                for node, offsets in groups:
                    # A page may have lost its source copy to eviction during the reservation:
                    # it then has none (eviction keeps the chain closed, not a copy per tier).
                    for src in sources:
                        held = node.slots[src][pool]
                        here = [j for j in offsets if held is not None and held[j] != ABSENT]
                        if not here or held is None:
                            continue
                        offsets = [j for j in offsets if j not in here]
                        mine = [next(pages) for _ in here]
                        txn.defer_copy(pool, src, [held[j] for j in here], dst, mine)
                        txn.place(node, dst, pool, here, mine)
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
