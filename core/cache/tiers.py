"""Tier policy: device pages to host by write-through, write-through-selective or
write-back; host pages to disk as they are evicted (where the pool has a disk tier); and
load-back to device, from the nearest tier holding each page, before use."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Mapping, Sequence

from .disk_store import CorruptPages
from .disk_tier import page_metas
from .layout import PoolName, Tier
from .lost_pages import LostPages
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
    """`policy`: when device pages get a host copy. `disk`: when pages get a disk copy
    (where the pool has a disk tier): as the host evicts them (WRITE_BACK), or as they
    are stored (WRITE_THROUGH: what a warm restart needs, as it finds only what is on
    disk, and write-back leaves there only pages cold in every pool)."""

    policy: WritePolicy = WritePolicy.WRITE_BACK
    selective_hits: int = 2
    disk: WritePolicy = WritePolicy.WRITE_BACK

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", WritePolicy(self.policy))
        object.__setattr__(self, "disk", WritePolicy(self.disk))
        if not isinstance(self.selective_hits, int) or self.selective_hits < 1:
            raise ValueError(f"selective_hits must be an int >= 1, got {self.selective_hits!r}")
        if self.disk not in (WRITE_THROUGH, WRITE_BACK):
            raise ValueError(f"the disk tier is written through or back, not {self.disk.value}")


class TierController:
    def __init__(
        self,
        registry: PoolRegistry,
        config: TierConfig,
        begin: Callable[[], Transaction],
        page_bytes: int,
        lost: LostPages,
    ) -> None:
        """`lost`: where a load records the pages whose disk copy failed its checksum."""
        self.registry = registry
        self.lost = lost
        self.page_bytes = page_bytes  # token bytes of a page, which a page on disk records
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

    def after_insert(self, nodes: list[TreeNode], filled: Mapping[PoolName, Sequence[int]]) -> None:
        """An insert's nodes, of which those holding positions it `filled` (per pool) took
        pages: those get copies where a tier is written through."""
        through = self.config.policy is WRITE_THROUGH
        disk_through = self.config.disk is WRITE_THROUGH
        if not (through or disk_through):
            return  # first: the default, once a put
        first = min((pos[0] for pos in filled.values() if pos), default=None)
        took = [] if first is None else [x for x in nodes if x.end > first]
        if through:
            self.backup(took)
        if disk_through:
            self.backup(took, Tier.DISK)

    def after_hit(self, nodes: list[TreeNode]) -> None:
        if self.config.policy == WritePolicy.WRITE_THROUGH_SELECTIVE:
            n = self.config.selective_hits
            self.backup([node for node in nodes if node.hits >= n])

    def backup(self, nodes: list[TreeNode], to: Tier = Tier.HOST) -> bool:
        """Copy the pages of `nodes` in memory that lack a copy on `to` (host, or disk) there,
        whole or not at all."""
        sources = (Tier.DEVICE,) if to is Tier.HOST else (Tier.HOST, Tier.DEVICE)
        todo = {}
        for pool in self.registry.names:
            if self.registry.pool(pool, to).capacity:
                groups = [(n, _lacking(n, pool, have=sources, want=to)) for n in nodes]
                todo[pool] = [(n, offs) for n, offs in groups if offs]
        if not any(todo.values()):
            return True
        ok = self._move(todo, sources, to)
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
        """Copy each page of `todo` to `dst` from the first of `sources` holding it. False
        where there is no room, or a page read from disk failed its checksum (recorded
        in `lost`; the copies are undone, none is served)."""
        read: dict[tuple[PoolName, int], tuple[TreeNode, int]] = {}  # disk slot -> its page
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
                        if not here:
                            continue
                        assert held is not None  # `here` is empty otherwise
                        offsets = [j for j in offsets if j not in here]
                        mine = [next(pages) for _ in here]
                        metas = page_metas(node, here, self.page_bytes) if dst is Tier.DISK else ()
                        txn.defer_copy(pool, src, [held[j] for j in here], dst, mine, metas)
                        txn.place(node, dst, pool, here, mine)
                        if src is Tier.DISK:
                            read.update(((pool, held[j]), (node, j)) for j in here)
            try:
                txn.commit()  # runs the copies: a failing one is undone with the rest
            except CorruptPages as e:
                txn.rollback()
                for slot in e.slots:
                    node, j = read[(e.pool, slot)]
                    self.lost.add(node, e.pool, j, slot)
                return False
        finally:
            txn.rollback()  # a no-op once committed
        return True


def _lacking(node: TreeNode, pool: PoolName, have: tuple[Tier, ...], want: Tier) -> list[int]:
    """Offsets of `node`'s pages on one of `have` with no copy on `want`."""
    dst = node.slots[want][pool]
    return [
        j
        for j in range(node.n)
        if (dst is None or dst[j] == ABSENT) and node.page_has(j, pool, have)
    ]


def _size(todo: dict[PoolName, list[tuple[TreeNode, list[int]]]]) -> int:
    return sum(len(offs) for groups in todo.values() for _, offs in groups)
