"""Device <-> host tier policy: write-through, write-through-selective,
write-back, and load-back of host-only pages before use."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

from .layout import PoolName, Tier
from .pools import PoolRegistry
from .radix import ABSENT, Node
from .txn import ReservationFailed, Transaction


class WritePolicy(str, Enum):
    WRITE_THROUGH = "write_through"                       # copy to host on insert
    WRITE_THROUGH_SELECTIVE = "write_through_selective"   # copy after N hits
    WRITE_BACK = "write_back"                             # copy on device eviction


@dataclass(frozen=True)
class TierConfig:
    policy: WritePolicy = WritePolicy.WRITE_BACK
    selective_hits: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", WritePolicy(self.policy))
        if not isinstance(self.selective_hits, int) or self.selective_hits < 1:
            raise ValueError(f"selective_hits must be an int >= 1, got {self.selective_hits!r}")


class TierController:
    def __init__(self, registry: PoolRegistry, config: TierConfig,
                 begin: Callable[[], Transaction]) -> None:
        self.registry = registry
        self.config = config
        self._begin = begin
        self.backed_up = 0
        self.loaded_back = 0
        self.backup_failures = 0

    def write_back(self) -> bool:
        return self.config.policy == WritePolicy.WRITE_BACK

    def after_insert(self, nodes: list[Node]) -> None:
        if self.config.policy == WritePolicy.WRITE_THROUGH:
            self.backup(nodes)

    def after_hit(self, nodes: list[Node]) -> None:
        if self.config.policy == WritePolicy.WRITE_THROUGH_SELECTIVE:
            n = self.config.selective_hits
            self.backup([node for node in nodes if node.hits >= n])

    def backup(self, nodes: list[Node]) -> bool:
        """Copy device pages lacking a host copy to host, whole or not at all."""
        todo = self._missing(nodes, have=Tier.DEVICE, want=Tier.HOST)
        if not todo:
            return True
        ok = self._move(todo, Tier.DEVICE, Tier.HOST)
        self.backed_up += ok * sum(len(v) for v in todo.values())
        self.backup_failures += not ok
        return ok

    def load_back(self, needs: dict[PoolName, list[Node]]) -> bool:
        """Give every node in `needs[pool]` a device copy of its `pool` page."""
        todo = {p: [n for n in nodes if n.slots[Tier.DEVICE][p] == ABSENT] for p, nodes in needs.items()}
        todo = {p: nodes for p, nodes in todo.items() if nodes}
        if not todo:
            return True
        ok = self._move(todo, Tier.HOST, Tier.DEVICE)
        self.loaded_back += ok * sum(len(v) for v in todo.values())
        return ok

    def _missing(self, nodes: list[Node], have: Tier, want: Tier) -> dict[PoolName, list[Node]]:
        out = {}
        for pool in self.registry.names:
            if self.registry.pool(pool, want).capacity == 0:
                continue
            todo = [n for n in nodes if n.slots[have][pool] != ABSENT and n.slots[want][pool] == ABSENT]
            if todo:
                out[pool] = todo
        return out

    def _move(self, todo: dict[PoolName, list[Node]], src: Tier, dst: Tier) -> bool:
        txn = self._begin()
        try:
            got = txn.reserve_all({(p, dst): len(nodes) for p, nodes in todo.items()})
        except ReservationFailed:
            return False
        for pool, nodes in todo.items():
            # A node may have lost its source copy to eviction during the reservation.
            pairs = [(n, i) for n, i in zip(nodes, got[(pool, dst)]) if n.slots[src][pool] != ABSENT]
            txn.defer_copy(pool, src, [n.slots[src][pool] for n, _ in pairs], dst, [i for _, i in pairs])
            for node, index in pairs:
                txn.place(node, dst, pool, index)
        txn.commit()
        return True
