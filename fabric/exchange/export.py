"""The source end of a remote prefix fetch: pin the usable prefix under a lease and
describe it (`ExportGrant`): page locations and per-page checksums."""
from __future__ import annotations

from typing import Sequence

from .grant import ExportGrant, PoolPages
from kvfabric.fabric.cache.layout import PoolName, Tier
from .leases import LeaseTable
from kvfabric.fabric.cache.node_cache import NodeCache
from kvfabric.fabric.cache.pages import page_checksums
from kvfabric.fabric.cache.paths import groups


def export_prefix(cache: NodeCache, leases: LeaseTable, keys: Sequence[bytes], skip: int,
                  ttl_s: float, device_only: bool = True) -> ExportGrant:
    """Pin and describe the usable prefix of `keys`, FULL pages from `skip` on.

    With `device_only` (what a NIXL read from GPU memory wants), host-only pages
    are loaded back first; if there is no device room, the grant ends where the
    device-resident prefix ends."""
    match = cache.match_keys(list(keys))
    n = match.pages
    if n <= skip:
        return ExportGrant(0, cache.layout.fingerprint, n, tuple(match.keys[:n]))
    lock = cache.lock(match, n)
    lease, granted = None, False
    try:
        path = [x for x in match.path if x.start < n]
        if device_only and not cache.tiers.load_back({p: groups(path, pol.needed(n))
                                                      for p, pol in cache.policies.items()}):
            n = cache.usable(path, n, (Tier.DEVICE,))
            if n <= skip:
                return ExportGrant(0, cache.layout.fingerprint, n, tuple(match.keys[:n]))
        lease = leases.grant(lock, ttl_s)
        pools = {pool: _describe(cache, path, pool, span)
                 for pool, span in _spans(cache, n, skip).items()}
        granted = True
        return ExportGrant(lease.lease_id, cache.layout.fingerprint, n, tuple(match.keys[:n]), pools)
    finally:
        if not granted:       # nothing pinned for nothing, whatever stopped the export
            if lease is not None:
                leases.release(lease.lease_id)
            else:
                cache.unlock(lock)


def _spans(cache: NodeCache, n: int, skip: int) -> dict[PoolName, range]:
    """What a grant of n pages describes: FULL pages from `skip` on, the SWA window."""
    return {pool: range(skip, n) if pool == PoolName.FULL else policy.needed(n)
            for pool, policy in cache.policies.items()}


def _describe(cache: NodeCache, path, pool: PoolName, span: range) -> PoolPages:
    refs = [(_tier_of(x, pool, j), x, j) for x, offs in groups(path, span) for j in offs]
    tiers = [t for t, _, _ in refs]
    indices = [x.slots[t][pool][j] for t, x, j in refs]
    sums = _checksums(cache, pool, tiers, indices)
    return PoolPages(span.start, tuple(int(t) for t in tiers), tuple(indices), tuple(sums))


def _tier_of(node, pool: PoolName, offset: int) -> Tier:
    return Tier.DEVICE if node.page_has(offset, pool, (Tier.DEVICE,)) else Tier.HOST


def _checksums(cache: NodeCache, pool: PoolName, tiers: list[Tier], indices: list[int]) -> list[int]:
    out = [0] * len(indices)
    for tier in (Tier.DEVICE, Tier.HOST):
        at = [i for i, t in enumerate(tiers) if t == tier]
        for i, s in zip(at, page_checksums(cache.registry.pool(pool, tier), [indices[i] for i in at])):
            out[i] = s
    return out

