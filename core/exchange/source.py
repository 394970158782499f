"""The source end of a remote prefix fetch: pin the usable prefix under a lease and
describe it (`ExportGrant`): page locations and per-page checksums."""

from __future__ import annotations

from typing import Sequence

from kvfabric.core.cache.layout import PoolName
from kvfabric.core.cache.leases import LeaseTable
from kvfabric.core.cache.match import Match
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.radix import DEVICE_ONLY
from kvfabric.core.cache.shared_pages import MEMORY

from .grant import ExportGrant, PoolPages


def export_prefix(
    cache: NodeCache,
    leases: LeaseTable,
    keys: Sequence[bytes],
    skip: int,
    ttl_s: float,
    device_only: bool = True,
) -> ExportGrant:
    """Pin and describe the usable prefix of `keys`, FULL pages from `skip` on.

    With `device_only` (what a NIXL read from GPU memory wants), host-only pages
    are loaded back first; if there is no device room, the grant ends where the
    device-resident prefix ends. Pages on disk only are loaded back either way."""
    match = cache.match_keys(list(keys))
    n = match.usable_pages
    if n <= skip:
        return ExportGrant(0, cache.layout.fingerprint, n, tuple(match.keys[:n]))
    lock = cache.lock(match, n)
    lease, granted = None, False
    try:
        # Pages on disk only are loaded either way: peers read memory.
        n = cache.load_to_device(match, n, DEVICE_ONLY if device_only else MEMORY).pages
        if n <= skip:
            return ExportGrant(0, cache.layout.fingerprint, n, tuple(match.keys[:n]))
        lease = leases.grant(lock, ttl_s)
        pools = {
            pool: _describe(cache, match, pool, span)
            for pool, span in cache.export_spans(n, skip).items()
        }
        granted = True
        return ExportGrant(
            lease.lease_id, cache.layout.fingerprint, n, tuple(match.keys[:n]), pools
        )
    finally:
        if not granted:  # nothing pinned for nothing, whatever stopped the export
            if lease is not None:
                leases.release(lease.lease_id)
            else:
                cache.unlock(lock)


def _describe(cache: NodeCache, match: Match, pool: PoolName, span: range) -> PoolPages:
    at = cache.locate(match, pool, span)
    return PoolPages(
        span.start,
        tuple(int(t) for t, _ in at),
        tuple(i for _, i in at),
        tuple(cache.checksums(pool, at)),
    )
