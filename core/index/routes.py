"""The route table of the sharded prefix index: which shard owns which subtree.

A route names a subtree by the chained key of its root page (a key names its
whole prefix) and maps it to a shard, or spreads its children over all
shards by a hash of the child's key (so children that appear later spread
too: on conversation traffic new branches keep appearing under a shared
system prompt). A lookup walks the table along its page keys and goes to the
one shard owning the deepest region it enters; pages outside every route
belong to a default shard chosen by the first page's key.
The shard of a route also holds the route's ancestor pages (replicated), so
it can answer a lookup alone, the SWA window at a route boundary included.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import msgpack
from kvfabric.core.cache.keys import KEY_BYTES
from kvfabric.core.wire import is_int, unpack

ROUTES_VERSION = 1
MAX_SHARDS = 1024  # a spread route lists every shard per key: bound what a table may ask for


class RouteError(ValueError):
    """A route table (or split) that does not hold together."""


@dataclass(frozen=True)
class Route:
    path: tuple[bytes, ...]  # page keys from depth 0 to the route's root page
    shard: int  # owner of the route's own pages (and of its children, unless spread)
    spread: bool = False  # each child subtree goes to the shard its key hashes to

    @property
    def key(self) -> bytes:
        return self.path[-1]


class RouteTable:
    def __init__(self, shards: int, routes: Sequence[Route] = (), version: int = 0) -> None:
        if not is_int(shards) or not 1 <= shards <= MAX_SHARDS:
            raise RouteError(f"shards must be an int in [1, {MAX_SHARDS}], got {shards!r}")
        if not is_int(version) or version < 0:
            raise RouteError(f"version must be an int >= 0, got {version!r}")
        self.shards, self.version = shards, version
        self._routes: dict[bytes, Route] = {}
        self._above: dict[
            bytes, set[int] | frozenset[int]
        ] = {}  # key above some route -> those routes' shards
        self._all = frozenset(range(shards))  # shared by the keys of spread routes
        for r in routes:
            self._add(r)

    def _add(self, route: Route) -> None:
        if not is_int(route.shard) or not 0 <= route.shard < self.shards or not route.path:
            raise RouteError(
                f"route to shard {route.shard} of {self.shards} with {len(route.path)} pages"
            )
        if route.key in self._routes:
            raise RouteError("two routes for one subtree")
        self._routes[route.key] = route
        above = self._above
        for k in route.path if route.spread else route.path[:-1]:
            held = above.get(k)
            if route.spread:
                above[k] = self._all
            elif held is None:
                above[k] = {route.shard}
            elif isinstance(held, set):  # not the shared frozenset of every shard
                held.add(route.shard)

    @property
    def routes(self) -> list[Route]:
        return list(self._routes.values())

    def default_shard(self, first_key: bytes) -> int:
        return self.hashed(first_key)

    def hashed(self, key: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % self.shards

    def owner(self, keys: Sequence[bytes]) -> int:
        """The shard that answers a lookup of `keys` (the deepest route passed)."""
        return self.locate(keys)[0] if keys else 0

    def locate(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """(shard, depth of the region's root page) for a non-empty key path:
        the deepest route passed, else the first page's default region."""
        routes, shard, root = self._routes, None, 0
        last = len(keys) - 1
        for depth, k in enumerate(keys):
            r = routes.get(k)
            if r is None:
                continue
            if r.spread and depth < last:
                shard, root = self.hashed(keys[depth + 1]), depth + 1
            else:
                shard, root = r.shard, depth
        if shard is None:
            return self.default_shard(keys[0]), 0
        return shard, root

    def shards_for(self, path: Sequence[bytes]) -> set[int]:
        """Shards that must hear of the page ending `path`: its region's owner,
        and the owners of routes below it (they replicate their ancestors)."""
        return {self.owner(path), *self._above.get(path[-1], ())}

    def split(
        self, path: Sequence[bytes], children: Sequence[bytes], shards: Sequence[int]
    ) -> "RouteTable":
        """A new table in which each child subtree of the page ending `path` is
        its own route, on the given shard."""
        if len(children) != len(shards) or len(set(children)) != len(children):
            raise RouteError("one shard per distinct child")
        table = RouteTable(self.shards, self.routes, self.version + 1)
        for child, shard in zip(children, shards):
            table._add(Route((*path, child), shard))
        return table

    def spread(self, path: Sequence[bytes], owner: int) -> "RouteTable":
        """A new table in which the children of the page ending `path` spread
        over all shards by key hash; `owner` keeps the page itself."""
        kept = [r for r in self.routes if r.key != path[-1]]  # a route there becomes a spread one
        table = RouteTable(self.shards, kept, self.version + 1)
        table._add(Route(tuple(path), owner, spread=True))
        return table

    def move(self, path: Sequence[bytes], shard: int) -> "RouteTable":
        """A new table in which the subtree of the page ending `path` is on `shard`
        (a route there keeps spreading its children, if it did)."""
        old = self._routes.get(path[-1])
        kept = [r for r in self.routes if r.key != path[-1]]
        table = RouteTable(self.shards, kept, self.version + 1)
        table._add(Route(tuple(path), shard, spread=old is not None and old.spread))
        return table

    def encode(self) -> bytes:
        return msgpack.packb(
            [
                ROUTES_VERSION,
                self.version,
                self.shards,
                [[list(r.path), r.shard, r.spread] for r in self._routes.values()],
            ]
        )

    @classmethod
    def decode(cls, data: bytes) -> "RouteTable":
        """Decode and validate an encoded table; raises RouteError saying what is wrong."""
        msg = unpack(data, RouteError, "route table")
        if not isinstance(msg, list) or len(msg) != 4:
            raise RouteError("a route table is [format version, version, shards, routes]")
        v, version, shards, routes = msg
        if not is_int(v) or v != ROUTES_VERSION or not is_int(version) or version < 0:
            raise RouteError(f"route table version {v!r}/{version!r} not understood")
        if not isinstance(routes, list):
            raise RouteError("routes must be a list")
        parsed = []
        for r in routes:
            if not (
                isinstance(r, list)
                and len(r) == 3
                and isinstance(r[0], list)
                and all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in r[0])
                and is_int(r[1])
                and isinstance(r[2], bool)
            ):
                raise RouteError(f"a route is [[{KEY_BYTES}-byte keys...], shard, spread]")
            parsed.append(Route(tuple(r[0]), r[1], r[2]))
        return cls(shards, parsed, version)
