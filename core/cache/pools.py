"""Page pools and the registry that says which exist.

For each pool name (FULL, SWA) and tier (DEVICE, HOST) there is one tensor of
pages and one allocator. Code asks the registry which pools exist; a layout
without SWA layers simply has no SWA entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from .allocator import PageAllocator
from .layout import KVLayout, PoolName, Tier


@dataclass(frozen=True)
class PoolCapacity:
    device: int
    host: int = 0

    def __post_init__(self) -> None:
        for name in ("device", "host"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"pool capacity {name} must be an int >= 0, got {v!r}")

    def of(self, tier: Tier) -> int:
        return self.device if tier == Tier.DEVICE else self.host


@dataclass
class PagePool:
    """One tensor of pages (or none, in metadata-only mode) and its allocator."""

    name: PoolName
    tier: Tier
    allocator: PageAllocator
    data: torch.Tensor | None

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

    def tier(self, tier: Tier) -> PagePool:
        return self.device if tier == Tier.DEVICE else self.host

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
    ) -> "PoolRegistry":
        missing = set(layout.pools) - set(capacities)
        extra = set(capacities) - set(layout.pools)
        if missing or extra:
            raise ValueError(
                f"capacities must name exactly the layout's pools {list(layout.pools)}; "
                f"missing {sorted(missing)}, extra {sorted(extra)}"
            )
        device = torch.device(device) if device is not None else default_device()
        entries = {}
        for name in layout.pools:
            cap = capacities[name]
            pools = [
                _make_pool(layout, name, tier, cap.of(tier), device, store_bytes)
                for tier in (Tier.DEVICE, Tier.HOST)
            ]
            entries[name] = PoolEntry(name, pools[0], pools[1])
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
