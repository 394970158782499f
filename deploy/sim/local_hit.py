"""What a node's own cache gives a prefill, by tier: the replay's nodes hold pages on device,
host and disk (`SimConfig.host_tokens`, `disk_tokens`), and a page below the device is read up
before the prefill can use it, at its tier's bandwidth (`CostModel.load_s`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache

ON_DEVICE = (Tier.DEVICE,)
IN_MEMORY = (Tier.DEVICE, Tier.HOST)


@dataclass(frozen=True)
class LocalHit:
    """The pages of a local hit, each with the nearest tier it was read from."""

    tiers: tuple[Tier, ...]

    @property
    def pages(self) -> int:
        return len(self.tiers)

    def pages_on(self, tier: Tier) -> int:
        return self.tiers.count(tier)

    def positions_on(self, tier: Tier) -> list[int]:
        return [j for j, t in enumerate(self.tiers) if t is tier]


NO_HIT = LocalHit(())


def take_local_hit(cache: NodeCache, tokens: Sequence[int], namespace: str) -> LocalHit:
    """What `cache` holds of `tokens`, loaded to its device as the engine's `get` does (what
    comes up pushes device pages down a tier), by the tier each page was on before. The
    replay's caches have one pool, FULL: every page of a hit is read."""
    match = cache.match(tokens, namespace)
    on_device = cache.presence(match, PoolName.FULL, ON_DEVICE)
    in_memory = cache.presence(match, PoolName.FULL, IN_MEMORY)
    # Fewer pages than matched when the device has no room for all of them.
    pages = cache.get(tokens, namespace).tokens // cache.layout.page_size
    return LocalHit(
        tuple(
            Tier.DEVICE if on_device[j] else Tier.HOST if in_memory[j] else Tier.DISK
            for j in range(pages)
        )
    )
