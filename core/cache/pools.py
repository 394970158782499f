"""Page pools and the registry that says which exist.

For each pool name (FULL, SWA) and tier there is one allocator and the pages' bytes:
a tensor on the device and host tiers, a page file on the disk tier (disk_store.py).
Code asks the registry which pools exist; a layout without SWA layers simply has no
SWA entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from .allocator import PageAllocator
from .disk_store import DiskStore
from .layout import KVLayout, PoolName, Tier


@dataclass(frozen=True)
class PoolCapacity:
    device: int
    host: int = 0
    disk: int = 0

    def __post_init__(self) -> None:
        for name in ("device", "host", "disk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"pool capacity {name} must be an int >= 0, got {v!r}")

    def of(self, tier: Tier) -> int:
        return (self.device, self.host, self.disk)[tier]


@dataclass
class PagePool:
    """One tier's pages of one pool and their allocator. The bytes are a tensor (device
    and host), a page file (`disk`: the disk tier), or neither (metadata-only mode)."""

    name: PoolName
    tier: Tier
    allocator: PageAllocator
    data: torch.Tensor | None
    disk: DiskStore | None = None

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def index_tensor(self, indices: list[int]) -> torch.Tensor:
        device = self.data.device if self.data is not None else "cpu"
        return torch.tensor(indices, dtype=torch.long, device=device)


@dataclass
class PoolEntry:
    name: PoolName
    device: PagePool
    host: PagePool
    disk: PagePool

    def tier(self, tier: Tier) -> PagePool:
        return (self.device, self.host, self.disk)[tier]

    def alloc(self, tier: Tier, n: int) -> list[int]:
        return self.tier(tier).allocator.alloc(n)

    def free(self, tier: Tier, indices: list[int]) -> None:
        self.tier(tier).allocator.free(indices)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class PoolRegistry:
    """Pool name -> entry. Iterating yields the entries that exist, in pool order."""

    def __init__(self, entries: Mapping[PoolName, PoolEntry]) -> None:
        self._entries = dict(sorted(entries.items()))
        # Indexed by pool number: hashing an enum member costs a Python call.
        self._by_index: list[PoolEntry | None] = [entries.get(p) for p in PoolName]
        # Each pool's device allocator, for the insert path: it checks and takes free pages
        # on every put.
        self.device_allocators = {name: e.device.allocator for name, e in self._entries.items()}

    @classmethod
    def build(
        cls,
        layout: KVLayout,
        capacities: Mapping[PoolName, PoolCapacity],
        device: torch.device | str | None = None,
        store_bytes: bool = True,
        disk: DiskStore | None = None,
    ) -> "PoolRegistry":
        """`disk`: the store holding the disk tier's pages, with the slots of each pool
        given a disk capacity (none: no disk tier)."""
        missing = set(layout.pools) - set(capacities)
        extra = set(capacities) - set(layout.pools)
        if missing or extra:
            raise ValueError(
                f"capacities must name exactly the layout's pools {list(layout.pools)}; "
                f"missing {sorted(missing)}, extra {sorted(extra)}"
            )
        on_disk = {name: cap.disk for name, cap in capacities.items() if cap.disk}
        have = {} if disk is None else {p: a.capacity for p, a in disk.slots.items()}
        if have != on_disk and (store_bytes or disk is not None):
            raise ValueError(f"disk capacities {on_disk} but the disk store holds {have}")
        device = torch.device(device) if device is not None else default_device()
        entries = {}
        for name in layout.pools:
            cap = capacities[name]
            pools = [
                _make_pool(layout, name, tier, cap.of(tier), device, store_bytes)
                for tier in (Tier.DEVICE, Tier.HOST)
            ]
            if disk is not None and name in disk.slots:
                on = PagePool(name, Tier.DISK, disk.slots[name], None, disk)
            else:  # no disk tier, or one of metadata only
                on = PagePool(name, Tier.DISK, PageAllocator(cap.disk), None)
            entries[name] = PoolEntry(name, pools[0], pools[1], on)
        return cls(entries)

    def __getitem__(self, name: PoolName) -> PoolEntry:
        entry = self._by_index[name]
        if entry is None:
            raise KeyError(name)
        return entry

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[PoolEntry]:
        return iter(self._entries.values())

    @property
    def names(self) -> tuple[PoolName, ...]:
        return tuple(self._entries)

    def pool(self, name: PoolName, tier: Tier) -> PagePool:
        return self[name].tier(tier)


def _make_pool(
    layout: KVLayout,
    name: PoolName,
    tier: Tier,
    capacity: int,
    device: torch.device,
    store_bytes: bool,
) -> PagePool:
    data = None
    if store_bytes:
        shape = (capacity, *layout.page_shape(name))
        if tier == Tier.DEVICE:
            data = torch.zeros(shape, dtype=layout.torch_dtype, device=device)
        else:
            # Pinned host memory lets device<->host copies run asynchronously.
            pin = device.type == "cuda"
            data = torch.zeros(shape, dtype=layout.torch_dtype, pin_memory=pin)
    return PagePool(name, tier, PageAllocator(capacity), data)
