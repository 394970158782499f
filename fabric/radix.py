"""The radix tree over pages: one node per page, one subtree per namespace.

A node is found two ways: by walking children keyed by the page's token bytes
(cheap, no hashing of a prefix already cached), or by its chained page key
(`by_key`, for peers and the index, which speak in keys). A node records, per
tier and pool, the page index holding its KV (or ABSENT), lock counts per
pool, last access and hit count. Every mutation goes through `set_slot`,
`drop_slot`, `attach_chain` and `detach`, which keep the owned/protected
counters right and, when a journal is given, record how to undo themselves.
"""
from __future__ import annotations

from typing import Callable, Iterator, Protocol

from .layout import PoolName, Tier
from .pools import PoolRegistry

ABSENT = -1
TIERS = (Tier.DEVICE, Tier.HOST)


class Journal(Protocol):
    def record(self, undo: Callable[[], None]) -> None: ...


class Node:
    __slots__ = ("key", "page", "parent", "children", "depth", "slots", "locks", "last_access", "hits")

    def __init__(self, key: bytes, page: bytes, parent: "Node | None", depth: int) -> None:
        self.key = key              # chained page key (namespace root key for a root)
        self.page = page            # this page's token bytes
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.depth = depth
        self.slots = [[ABSENT, ABSENT], [ABSENT, ABSENT]]   # [tier][pool] -> page index
        self.locks = [0, 0]                                  # per pool
        self.last_access = 0
        self.hits = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def has(self, pool: PoolName, tiers: tuple[Tier, ...] = TIERS) -> bool:
        s = self.slots
        return any(s[t][pool] != ABSENT for t in tiers)

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}, key={self.key.hex()[:8]}, slots={self.slots}, locks={self.locks})"


class RadixTree:
    def __init__(self, registry: PoolRegistry, page_bytes: int) -> None:
        self.registry = registry
        self.page_bytes = page_bytes
        self.roots: dict[bytes, Node] = {}       # namespace root key -> root (holds no pages)
        self.by_key: dict[bytes, Node] = {}
        self.clock = 0
        self.node_count = 0
        self.owned = [[0, 0], [0, 0]]       # [tier][pool] pages held by nodes
        self.protected = [[0, 0], [0, 0]]   # [tier][pool] pages held by locked nodes

    # --- reading -----------------------------------------------------------------
    def walk(self, root_key: bytes, raw: bytes) -> list[Node]:
        """Nodes along the whole pages of encoded tokens `raw`, up to the first miss."""
        path: list[Node] = []
        node = self.roots.get(root_key)
        if node is None:
            return path
        step = self.page_bytes
        for off in range(0, len(raw) - step + 1, step):
            node = node.children.get(raw[off:off + step])
            if node is None:
                break
            path.append(node)
        return path

    def walk_keys(self, keys: list[bytes]) -> list[Node]:
        """Nodes named by a chain of page keys, up to the first key not held."""
        path: list[Node] = []
        for k in keys:
            node = self.by_key.get(k)
            if node is None:
                break
            linked = node.parent is path[-1] if path else node.parent.is_root
            if not linked:
                break
            path.append(node)
        return path

    def nodes(self) -> Iterator[Node]:
        """Every page node, parents before children."""
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def touch(self, path: list[Node], hit: bool = False) -> None:
        now = self.tick()
        for node in path:
            node.last_access = now
            if hit:
                node.hits += 1

    # --- structure -----------------------------------------------------------------
    def root(self, root_key: bytes) -> Node:
        node = self.roots.get(root_key)
        if node is None:
            node = self.roots[root_key] = Node(root_key, b"", None, 0)
        return node

    def attach_chain(self, parent: Node, keys: list[bytes], pages: list[bytes],
                     journal: Journal | None) -> list[Node]:
        """Add a chain of new nodes below `parent`, one per (key, page)."""
        out = []
        now, by_key, top = self.clock, self.by_key, parent
        for key, page in zip(keys, pages):
            node = Node(key, page, parent, parent.depth + 1)
            node.last_access = now
            parent.children[page] = node
            by_key[key] = node
            out.append(node)
            parent = node
        self.node_count += len(out)
        if journal is not None and out:
            def undo() -> None:
                for node in reversed(out):
                    self.detach(node, None)
            journal.record(undo)
        return out

    def detach(self, node: Node, journal: Journal | None) -> None:
        assert not node.children and not any(node.has(p) for p in PoolName), node
        parent = node.parent
        del parent.children[node.page]
        del self.by_key[node.key]
        self.node_count -= 1
        if parent.is_root and not parent.children:
            del self.roots[parent.key]
        if journal is not None:
            journal.record(lambda: self._reattach(node))

    def _reattach(self, node: Node) -> None:
        parent = node.parent
        if parent.is_root:
            self.roots.setdefault(parent.key, parent)
        parent.children[node.page] = node
        self.by_key[node.key] = node
        self.node_count += 1

    # --- pages -----------------------------------------------------------------------
    def set_slot(self, node: Node, tier: Tier, pool: PoolName, index: int,
                 journal: Journal | None) -> None:
        """Give an already-allocated page to `node` (the tree now owns it)."""
        assert node.slots[tier][pool] == ABSENT, (node, tier, pool)
        node.slots[tier][pool] = index
        self._count(node, tier, pool, +1)
        if journal is not None:
            journal.record(lambda: self._clear(node, tier, pool))

    def drop_slot(self, node: Node, tier: Tier, pool: PoolName, journal: Journal | None) -> int:
        """Free `node`'s page in (tier, pool) back to its allocator."""
        index = node.slots[tier][pool]
        assert index != ABSENT, (node, tier, pool)
        self._clear(node, tier, pool)
        allocator = self.registry.pool(pool, tier).allocator
        allocator.free([index])
        if journal is not None:
            def undo() -> None:
                allocator.take([index])
                node.slots[tier][pool] = index
                self._count(node, tier, pool, +1)
            journal.record(undo)
        return index

    def _clear(self, node: Node, tier: Tier, pool: PoolName) -> None:
        node.slots[tier][pool] = ABSENT
        self._count(node, tier, pool, -1)

    def _count(self, node: Node, tier: Tier, pool: PoolName, delta: int) -> None:
        self.owned[tier][pool] += delta
        if node.locks[pool]:
            self.protected[tier][pool] += delta

    # --- locks -----------------------------------------------------------------------
    def lock(self, nodes: list[Node], pool: PoolName, delta: int) -> None:
        """Add `delta` (+1 or -1) to each node's lock on `pool`."""
        for node in nodes:
            before = node.locks[pool]
            after = before + delta
            if after < 0:
                raise RuntimeError(f"unlock of an unlocked node: {node}")
            node.locks[pool] = after
            if (before == 0) != (after == 0):
                sign = 1 if after else -1
                for t in TIERS:
                    if node.slots[t][pool] != ABSENT:
                        self.protected[t][pool] += sign
