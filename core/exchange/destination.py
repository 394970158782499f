"""The destination end of a remote prefix fetch, as one transaction.

The source answered an `ExportGrant` (source.py). The destination reserves what it
lacks (FULL for every missing page, SWA for the window), reads the pages through a
caller-given `PageReader`, verifies the checksums, and only then inserts. Any
failure frees what it reserved and inserts nothing; the caller releases the lease
(or it expires).
"""

from __future__ import annotations

from enum import Enum
from typing import Callable, Sequence

from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.txn import ReservationFailed

from .grant import ExportGrant

# read(pool, [(source tier, source page)], [destination device page]); raises ReadFailed.
# Any other exception is taken as a transfer abandoned, not known finished (may still write).
PageReader = Callable[[PoolName, list[tuple[Tier, int]], list[int]], None]


class ReadFailed(Exception):
    """What a PageReader raises when pages could not be read (error, deadline, dead peer).

    `may_still_write`: the transfer was abandoned, not known finished (a deadline
    passed on a hung peer), so its destination pages stay quarantined until that
    peer is known dead or the transfer is known complete (Transport.drained)."""

    def __init__(self, message: str, may_still_write: bool = False) -> None:
        super().__init__(message)
        self.may_still_write = may_still_write


class FetchOutcome(str, Enum):
    COMMITTED = "committed"
    NOTHING_TO_FETCH = "nothing_to_fetch"
    NO_ROOM = "no_room"
    TRANSFER_FAILED = "transfer_failed"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    BAD_GRANT = "bad_grant"
    PEER_QUARANTINED = (
        "peer_quarantined"  # an abandoned read from that peer may still write: refused
    )


def import_prefix(
    cache: NodeCache,
    tokens: Sequence[int],
    namespace: str,
    grant: ExportGrant,
    read: PageReader,
    peer: str | None = None,
) -> FetchOutcome:
    """Insert what `grant` offers beyond the local match, whole or not at all.

    While pages an abandoned read from `peer` may still write are quarantined, no
    new read from it starts: a hung peer holds one fetch's pages, not one per
    fetch. The caller frees it (NodeCache.release_quarantine) once the peer is dead
    or its given-up reads completed (a probe: see actors/node/peer_fetch.py)."""
    if peer is not None and cache.quarantines(peer):
        return FetchOutcome.PEER_QUARANTINED
    if grant.fingerprint != cache.layout.fingerprint:
        return FetchOutcome.BAD_GRANT
    n = grant.pages
    if n > len(tokens) // cache.layout.page_size or list(grant.keys) != cache.keys(
        tokens[: n * cache.layout.page_size], namespace
    ):
        return FetchOutcome.BAD_GRANT  # not this request's prefix (or another tenant's)
    plan = cache.plan_fetch(tokens, namespace, n)
    if plan.empty:
        return FetchOutcome.NOTHING_TO_FETCH
    if any(
        not grant.pools.get(p) or not all(grant.pools[p].covers(i) for i in pos)
        for p, pos in plan.todo.items()
        if pos
    ):
        return FetchOutcome.BAD_GRANT  # the source offers less than the missing pages
    try:
        failed = cache.insert(
            plan,
            lambda got, quarantine: _read_and_verify(
                cache, grant, plan.todo, got, read, quarantine
            ),
            writer=peer,
        )
    except ReservationFailed:
        return FetchOutcome.NO_ROOM
    return FetchOutcome.COMMITTED if failed is None else failed


def _read_and_verify(
    cache, grant, need, got, read, quarantine: Callable[[], None]
) -> FetchOutcome | None:
    """Read and check every missing page; an outcome if that failed. `quarantine` ends the
    transaction keeping its pages out of use, for a transfer that may still write."""
    for pool, positions in need.items():
        if not positions:
            continue
        refs = [grant.pools[pool].at(p) for p in positions]
        dst = got[(pool, Tier.DEVICE)]
        try:
            read(pool, [(t, i) for t, i, _ in refs], dst)
        except ReadFailed as e:
            if e.may_still_write:
                quarantine()
            return FetchOutcome.TRANSFER_FAILED
        except Exception:
            quarantine()  # a failure the reader did not report: nothing says its transfer stopped
            return FetchOutcome.TRANSFER_FAILED
        except BaseException:
            quarantine()
            raise
        try:
            sums = cache.checksums(pool, [(Tier.DEVICE, i) for i in dst])
        except Exception:
            return FetchOutcome.TRANSFER_FAILED  # bytes that cannot be checked are never used
        if sums != [s for _, _, s in refs]:
            return FetchOutcome.CHECKSUM_MISMATCH
    return None
