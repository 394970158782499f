"""A node cache's pages as it shares them with peers: a matched prefix made
device-resident, where each of its pages lies, page checksums, and the device pools a
transport registers. The exchange (exchange/source.py, the source end of a remote
fetch) and the transport use these and never reach the tree, the pools or the policies
themselves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .layout import PoolName, Tier
from .match import Match
from .page_bytes import page_checksums
from .paths import groups
from .policies import AttentionPolicy, usable_length
from .pools import PoolRegistry
from .radix import DEVICE_ONLY, TIERS
from .tiers import TierController


@dataclass(frozen=True)
class Loaded:
    """A prefix made device-resident: `pages` usable on the device now (fewer than asked
    when the device had no room), `from_host` of their positions copied up to get there."""

    pages: int
    from_host: int


MEMORY = (Tier.DEVICE, Tier.HOST)  # the tiers peers read pages from


class SharedPages:
    """What one cache shares with peers, read off its pools, policies and tiers."""

    def __init__(
        self,
        registry: PoolRegistry,
        policies: dict[PoolName, AttentionPolicy],
        tiers: TierController,
    ) -> None:
        self.registry = registry
        self.policies = policies
        self.tiers = tiers

    def load_to_device(self, match: Match, n: int, tiers: tuple[Tier, ...] = DEVICE_ONLY) -> Loaded:
        """Give what a match of `n` pages needs a copy on one of `tiers`, loading to device
        what has none (the caller holds the match locked)."""
        path = [x for x in match.path if x.start < n]
        needs = {p: groups(path, pol.needed(n)) for p, pol in self.policies.items()}
        from_host = {
            x.start + j
            for p, found in needs.items()
            for x, offs in found
            for j in offs
            if not x.page_has(j, p, tiers)
        }
        if not self.tiers.load_back(needs, tiers):
            return Loaded(usable_length(self.policies, path, n, tiers), 0)
        return Loaded(n, len(from_host))

    def back_up(self, match: Match) -> bool:
        """Copy the matched runs' device pages that lack a host copy to the host tier,
        whole or not at all (what write-through does after a put, on demand)."""
        return self.tiers.backup(match.path)

    def export_spans(self, n: int, skip: int) -> dict[PoolName, range]:
        """Per pool, the positions a peer's fetch of `n` pages reads (it holds `skip`)."""
        return {pool: policy.exported(n, skip) for pool, policy in self.policies.items()}

    def locate(self, match: Match, pool: PoolName, span: range) -> list[tuple[Tier, int]]:
        """Where each page of `span` of `pool` lies: its device copy if any, else the host's
        (a page on disk only is loaded first: load_to_device with MEMORY)."""
        out = []
        for node, offsets in groups(match.path, span):
            for j in offsets:
                tier = Tier.DEVICE if node.page_has(j, pool, DEVICE_ONLY) else Tier.HOST
                if not node.page_has(j, pool, (tier,)):
                    raise ValueError(f"page {node.start + j} of {pool.name} is on disk only")
                out.append((tier, node.pages_of(tier, pool)[j]))
        return out

    def checksums(self, pool: PoolName, pages: Sequence[tuple[Tier, int]]) -> list[int]:
        """The checksum of each (tier, page index) of `pool`, in order."""
        out = [0] * len(pages)
        for tier in TIERS:
            at = [i for i, (t, _) in enumerate(pages) if t == tier]
            if at:
                sums = page_checksums(self.registry.pool(pool, tier), [pages[i][1] for i in at])
                for i, s in zip(at, sums):
                    out[i] = s
        return out

    def device_pools(self) -> dict[PoolName, torch.Tensor | None]:
        """Each pool's device tensor (None when this cache stores no bytes)."""
        return {entry.name: entry.device.data for entry in self.registry}
