"""Both ends of a remote prefix fetch, as one transaction on the destination.

1. The source exports: it matches the keys, pins what a match of the length
   it really has needs under a lease, and answers page locations and per-page
   checksums (`ExportGrant`).
2. The destination reserves what it lacks (FULL for every missing page, SWA
   for the window), reads the pages through a caller-given `PageReader`,
   verifies the checksums, and only then inserts. Any failure frees what it
   reserved and inserts nothing; the caller releases the lease (or it expires).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

import msgpack

from .keys import KEY_BYTES
from .layout import PoolName, Tier
from .leases import LeaseTable
from .node_cache import NodeCache
from .paths import groups
from .pages import page_checksums
from .txn import ReservationFailed
from .wire import is_int, unpack

GRANT_VERSION = 1

# read(pool, [(source tier, source page)], [destination device page]); raises ReadFailed.
# Any other exception is taken as a transfer abandoned, not known finished (may still write).
PageReader = Callable[[PoolName, list[tuple[Tier, int]], list[int]], None]


class ReadFailed(Exception):
    """What a PageReader raises when pages could not be read (error, deadline, dead peer).

    `may_still_write`: the transfer was abandoned, not known finished (a deadline
    passed on a hung peer), so its destination pages stay quarantined until that
    peer is known dead or a later read from it completes."""

    def __init__(self, message: str, may_still_write: bool = False) -> None:
        super().__init__(message)
        self.may_still_write = may_still_write


class GrantError(ValueError):
    """An export grant that does not fit this cache or this request."""


class FetchOutcome(str, Enum):
    COMMITTED = "committed"
    NOTHING_TO_FETCH = "nothing_to_fetch"
    NO_ROOM = "no_room"
    TRANSFER_FAILED = "transfer_failed"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    BAD_GRANT = "bad_grant"
    PEER_QUARANTINED = "peer_quarantined"    # an abandoned read from that peer may still write: refused


@dataclass(frozen=True)
class PoolPages:
    """Source locations of consecutive pages of one pool, from position `first`."""
    first: int
    tiers: tuple[int, ...]
    indices: tuple[int, ...]
    checksums: tuple[int, ...]

    def at(self, position: int) -> tuple[Tier, int, int]:
        i = position - self.first
        return Tier(self.tiers[i]), self.indices[i], self.checksums[i]

    def covers(self, position: int) -> bool:
        return 0 <= position - self.first < len(self.indices)


@dataclass(frozen=True)
class ExportGrant:
    lease_id: int                   # 0: nothing pinned
    fingerprint: bytes
    pages: int                      # usable pages the source has for the asked keys
    keys: tuple[bytes, ...]         # keys of pages [0, pages)
    pools: dict[PoolName, PoolPages] = field(default_factory=dict)
    version: int = GRANT_VERSION

    def to_wire(self) -> dict:
        return {"v": self.version, "lease": self.lease_id, "fp": self.fingerprint, "pages": self.pages,
                "keys": list(self.keys),
                "pools": [[int(p), pp.first, list(pp.tiers), list(pp.indices), list(pp.checksums)]
                          for p, pp in self.pools.items()]}

    def encode(self) -> bytes:
        return msgpack.packb(self.to_wire())

    @classmethod
    def decode(cls, data: bytes) -> "ExportGrant":
        """An export reply as the source sends it (`encode`); raises GrantError."""
        return cls.from_wire(unpack(data, GrantError, "export grant"))

    @classmethod
    def from_wire(cls, msg: object) -> "ExportGrant":
        """Validate a decoded message; raises GrantError naming what is wrong."""
        try:
            return _parse_grant(msg)
        except (KeyError, TypeError, ValueError) as e:
            raise GrantError(f"bad export grant: {e}") from None


_GRANT_FIELDS = {"v", "lease", "fp", "pages", "keys", "pools"}
_POOL_NAMES = {int(p) for p in PoolName}


def _parse_grant(msg: object) -> ExportGrant:
    if not isinstance(msg, dict) or msg.keys() != _GRANT_FIELDS:
        got = sorted(map(repr, msg)) if isinstance(msg, dict) else type(msg).__name__
        raise ValueError(f"fields must be {sorted(_GRANT_FIELDS)}; got {got}")
    if not is_int(msg["v"]) or msg["v"] != GRANT_VERSION:
        raise ValueError(f"version {msg['v']!r}, expected {GRANT_VERSION}")
    lease, pages, keys = msg["lease"], msg["pages"], msg["keys"]
    if not is_int(lease) or lease < 0 or not is_int(pages) or pages < 0:
        raise ValueError("lease and pages must be ints >= 0")
    if not isinstance(msg["fp"], bytes) or len(msg["fp"]) != KEY_BYTES:
        raise ValueError(f"fingerprint must be {KEY_BYTES} bytes")
    if not isinstance(keys, list) or len(keys) != pages \
            or not all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys):
        raise ValueError(f"keys must be one {KEY_BYTES}-byte key per page")
    pools = {}
    if not isinstance(msg["pools"], list):
        raise ValueError("pools must be a list")
    for entry in msg["pools"]:
        if not isinstance(entry, list) or len(entry) != 5:
            raise ValueError("a pool entry is [pool, first, tiers, indices, checksums]")
        name, first, tiers, indices, sums = entry
        pool = PoolName(name) if is_int(name) and name in _POOL_NAMES else None
        if pool is None or pool in pools:
            raise ValueError(f"pool {name!r} is unknown or listed twice")
        lists = (tiers, indices, sums)
        if not is_int(first) or first < 0 or not all(isinstance(x, list) for x in lists) \
                or not len(tiers) == len(indices) == len(sums) or first + len(indices) > pages \
                or not all(t in (0, 1) and is_int(t) for t in tiers) \
                or not all(is_int(i) and i >= 0 for i in indices) or not all(is_int(s) for s in sums):
            raise ValueError(f"pool {pool.name}: malformed page list")
        pools[pool] = PoolPages(first, tuple(tiers), tuple(indices), tuple(sums))
    return ExportGrant(lease, msg["fp"], pages, tuple(keys), pools)


# --- source side ---------------------------------------------------------------------
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


# --- destination side ----------------------------------------------------------------
def import_prefix(cache: NodeCache, tokens: Sequence[int], namespace: str, grant: ExportGrant,
                  read: PageReader, peer: str | None = None) -> FetchOutcome:
    """Insert what `grant` offers beyond the local match, whole or not at all.

    While pages an abandoned read from `peer` may still write are quarantined, no
    new read from it starts: a hung peer holds one fetch's pages, not one per
    fetch. The caller frees it (NodeCache.release_quarantine) once the peer is dead
    or a later read from it completed (a probe: see actors/node_actor.py)."""
    if peer is not None and cache.quarantines(peer):
        return FetchOutcome.PEER_QUARANTINED
    if grant.fingerprint != cache.layout.fingerprint:
        return FetchOutcome.BAD_GRANT
    n = grant.pages
    if n > len(tokens) // cache.layout.page_size \
            or list(grant.keys) != cache.keys(tokens[: n * cache.layout.page_size], namespace):
        return FetchOutcome.BAD_GRANT     # not this request's prefix (or another tenant's)
    plan = cache.plan_fetch(tokens, namespace, n)
    if plan.empty:
        return FetchOutcome.NOTHING_TO_FETCH
    if any(not grant.pools.get(p) or not all(grant.pools[p].covers(i) for i in pos)
           for p, pos in plan.todo.items() if pos):
        return FetchOutcome.BAD_GRANT     # the source offers less than the missing pages
    try:
        failed = cache.insert(plan, lambda got, hold: _read_and_verify(cache, grant, plan.todo, got, read, hold),
                              writer=peer)
    except ReservationFailed:
        return FetchOutcome.NO_ROOM
    return FetchOutcome.COMMITTED if failed is None else failed


def _read_and_verify(cache, grant, need, got, read, hold: Callable[[], None]) -> FetchOutcome | None:
    """Read and check every missing page; an outcome if that failed. `hold` ends the
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
                hold()
            return FetchOutcome.TRANSFER_FAILED
        except Exception:
            hold()      # a failure the reader did not report: nothing says its transfer stopped
            return FetchOutcome.TRANSFER_FAILED
        except BaseException:
            hold()
            raise
        try:
            sums = page_checksums(cache.registry.pool(pool, Tier.DEVICE), dst)
        except Exception:
            return FetchOutcome.TRANSFER_FAILED     # bytes that cannot be checked are never used
        if sums != [s for _, _, s in refs]:
            return FetchOutcome.CHECKSUM_MISMATCH
    return None
