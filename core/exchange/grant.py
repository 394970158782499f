"""The export grant: what a source answers a remote prefix fetch, and its wire form.

The source pins the pages a match of the length it really has needs, under a lease,
and describes where each lies and its checksum (`ExportGrant`); the destination
validates that description as outside input before using any of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
from kvfabric.core.cache.keys import KEY_BYTES
from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.wire import is_int, unpack

GRANT_VERSION = 1


class GrantError(ValueError):
    """An export grant that does not fit this cache or this request."""


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
    lease_id: int  # 0: nothing pinned
    fingerprint: bytes
    pages: int  # usable pages the source has for the asked keys
    keys: tuple[bytes, ...]  # keys of pages [0, pages)
    pools: dict[PoolName, PoolPages] = field(default_factory=dict)
    version: int = GRANT_VERSION

    def to_wire(self) -> dict:
        return {
            "v": self.version,
            "lease": self.lease_id,
            "fp": self.fingerprint,
            "pages": self.pages,
            "keys": list(self.keys),
            "pools": [
                [int(p), pp.first, list(pp.tiers), list(pp.indices), list(pp.checksums)]
                for p, pp in self.pools.items()
            ],
        }

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
    if (
        not isinstance(keys, list)
        or len(keys) != pages
        or not all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    ):
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
        if (
            not is_int(first)
            or first < 0
            or not all(isinstance(x, list) for x in lists)
            or not len(tiers) == len(indices) == len(sums)
            or first + len(indices) > pages
            or not all(t in (0, 1) and is_int(t) for t in tiers)
            or not all(is_int(i) and i >= 0 for i in indices)
            or not all(is_int(s) for s in sums)
        ):
            raise ValueError(f"pool {pool.name}: malformed page list")
        pools[pool] = PoolPages(first, tuple(tiers), tuple(indices), tuple(sums))
    return ExportGrant(lease, msg["fp"], pages, tuple(keys), pools)
