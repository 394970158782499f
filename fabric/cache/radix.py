"""The radix tree over pages: one node per run of pages, one subtree per namespace.

A node holds a run of whole pages: their chained keys, their token bytes, and
per tier and pool a list of page indices (or None where the tier holds none
of the run's pages in that pool). Full KV moves between tiers a whole node at
a time; SWA pages can be tombstoned one by one (ABSENT in the list). Locks
are per node: a lock that ends inside a run splits the run first.

A node is found two ways: by walking children keyed by the first page's token
bytes (no hashing of a prefix already cached), or by any page's chained key
(`by_key`, for peers and the index, which speak in keys). Every mutation goes
through the methods below, which keep the owned/protected page counters right
and, when a journal is given, record how to undo themselves.
"""

from __future__ import annotations

from typing import Callable, Iterator, Protocol, Sequence

from .changes import ChangeLog
from .layout import PoolName, Tier

ABSENT = -1
TIERS = (Tier.DEVICE, Tier.HOST)


class Journal(Protocol):
    def record(self, undo: Callable[[], None]) -> None: ...

    def dropped(self, pool: PoolName, tier: Tier, pages: list[int]) -> None: ...


class TreeNode:
    __slots__ = (
        "keys",
        "tokens",
        "parent",
        "children",
        "start",
        "end",
        "slots",
        "locks",
        "last_access",
        "hits",
    )

    def __init__(
        self, keys: list[bytes], tokens: bytes, parent: "TreeNode | None", start: int
    ) -> None:
        self.keys = keys  # chained key of each page (a root: [namespace root key])
        self.tokens = tokens  # token bytes of the run
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.start = start  # position of the run's first page in the sequence
        self.end = start + len(keys) if parent is not None else 0
        self.slots: list[list[list[int] | None]] = [[None, None], [None, None]]  # [tier][pool]
        self.locks = [0, 0]  # per pool, for every page of the run
        self.last_access = 0
        self.hits = 0

    @property
    def n(self) -> int:
        return len(self.keys) if self.parent is not None else 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def up(self) -> "TreeNode":
        """The parent of a node that is not a namespace root."""
        parent = self.parent
        assert parent is not None, "a namespace root has no parent"
        return parent

    def pages_of(self, tier: Tier, pool: PoolName) -> list[int]:
        """The run's page list of (tier, pool), where the caller knows the run holds some."""
        pages = self.slots[tier][pool]
        assert pages is not None, (self, tier, pool)
        return pages

    def has(self, pool: PoolName, tiers: tuple[Tier, ...] = TIERS) -> bool:
        """Whether any page of the run holds `pool` KV on one of `tiers`."""
        return any(self.slots[t][pool] is not None for t in tiers)

    def page_has(self, offset: int, pool: PoolName, tiers: tuple[Tier, ...] = TIERS) -> bool:
        for t in tiers:
            pages = self.slots[t][pool]
            if pages is not None and pages[offset] != ABSENT:
                return True
        return False

    def count(self, tier: Tier, pool: PoolName) -> int:
        pages = self.slots[tier][pool]
        return 0 if pages is None else len(pages) - pages.count(ABSENT)

    def __repr__(self) -> str:
        return (
            f"TreeNode(start={self.start}, n={self.n}, key={self.keys[0].hex()[:8]}, "
            f"slots={self.slots}, locks={self.locks})"
        )


class RadixTree:
    def __init__(
        self,
        page_bytes: int,
        free_page: Callable[[PoolName, Tier, list[int]], None],
        take_page: Callable[[PoolName, Tier, list[int]], None],
    ) -> None:
        self.page_bytes = page_bytes
        self._free, self._take = free_page, take_page
        self.roots: dict[bytes, TreeNode] = {}  # namespace root key -> root
        self.by_key: dict[bytes, TreeNode] = {}  # page key -> the node whose run holds it
        self.clock = 0
        self.node_count = 0
        self.owned = [[0, 0], [0, 0]]  # [tier][pool] pages held by nodes
        self.protected = [[0, 0], [0, 0]]  # [tier][pool] pages held by locked nodes
        self.changes: ChangeLog | None = None  # with events on (an EventPublisher)

    # --- reading -----------------------------------------------------------------
    def walk(self, root_key: bytes, raw: bytes) -> tuple[list[TreeNode], int]:
        """Nodes along the whole pages of encoded tokens `raw`, and how many pages
        matched (the last node may match only part of its run)."""
        path: list[TreeNode] = []
        node = self.roots.get(root_key)
        step, off, end = self.page_bytes, 0, len(raw) - len(raw) % self.page_bytes
        while node is not None and off < end:
            node = node.children.get(raw[off : off + step])
            if node is None:
                break
            path.append(node)
            if raw.startswith(node.tokens, off):  # compares in place: no copy of the run
                off += len(node.tokens)
                continue
            k = 1
            while (
                off + (k + 1) * step <= end
                and raw[off + k * step : off + (k + 1) * step]
                == node.tokens[k * step : (k + 1) * step]
            ):
                k += 1
            return path, node.start + k
        return path, off // step

    def walk_keys(self, keys: list[bytes]) -> tuple[list[TreeNode], int]:
        """The same for a chain of page keys, up to the first key not held here."""
        path: list[TreeNode] = []
        for i, k in enumerate(keys):
            node = self.by_key.get(k)
            if node is None:
                break
            offset = i - node.start
            if not 0 <= offset < node.n or node.keys[offset] != k:
                break
            if offset == 0:
                if (node.parent is not path[-1]) if path else not node.up.is_root:
                    break
                path.append(node)
            elif not path or path[-1] is not node:
                break
        else:
            return path, len(keys)
        return path, i

    def nodes(self) -> Iterator[TreeNode]:
        """Every page node, parents before children."""
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def touch(self, nodes: list[TreeNode], hit: bool = False) -> None:
        now = self.tick()
        for node in nodes:
            node.last_access = now
            node.hits += hit

    # --- structure -----------------------------------------------------------------
    def root(self, root_key: bytes) -> TreeNode:
        node = self.roots.get(root_key)
        if node is None:
            node = self.roots[root_key] = TreeNode([root_key], b"", None, 0)
        return node

    def attach(
        self, parent: TreeNode, keys: list[bytes], tokens: bytes, journal: Journal | None
    ) -> TreeNode:
        node = TreeNode(keys, tokens, parent, parent.end)
        node.last_access = self.clock
        parent.children[tokens[: self.page_bytes]] = node
        self.by_key.update(dict.fromkeys(keys, node))
        self.node_count += 1
        if self.changes is not None:
            self.changes.touched(keys)
        if journal is not None:
            journal.record(lambda: self.detach(node, None))
        return node

    def detach(self, node: TreeNode, journal: Journal | None) -> None:
        assert not node.children and not any(node.slots[t][p] for t in TIERS for p in PoolName), (
            node
        )
        parent = node.up
        del parent.children[node.tokens[: self.page_bytes]]
        for k in node.keys:
            del self.by_key[k]
        self.node_count -= 1
        if self.changes is not None:
            self.changes.left(node)
        if parent.is_root and not parent.children:
            del self.roots[parent.keys[0]]
        if journal is not None:
            journal.record(lambda: self._reattach(node))

    def _reattach(self, node: TreeNode) -> None:
        if self.changes is not None:
            self.changes.touched(node.keys)
        parent = node.up
        if parent.is_root:
            self.roots.setdefault(parent.keys[0], parent)
        parent.children[node.tokens[: self.page_bytes]] = node
        self.by_key.update(dict.fromkeys(node.keys, node))
        self.node_count += 1

    def split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut `node`'s run after its first k pages; returns the new head node.

        Structure only: pages, locks and the per-page view are unchanged, so
        splits need no undo."""
        assert 0 < k < node.n, (node, k)
        step = self.page_bytes
        parent = node.up
        head = TreeNode(node.keys[:k], node.tokens[: k * step], parent, node.start)
        head.locks = list(node.locks)
        head.last_access, head.hits = node.last_access, node.hits
        for head_slots, slots in zip(head.slots, node.slots):  # per tier, then per pool
            for p, pages in enumerate(slots):
                if pages is not None:
                    head_slots[p] = _none_if_empty(pages[:k])
                    slots[p] = _none_if_empty(pages[k:])
        parent.children[node.tokens[:step]] = head
        node.keys, node.tokens, node.start, node.parent = (
            node.keys[k:],
            node.tokens[k * step :],
            node.start + k,
            head,
        )
        head.children[node.tokens[:step]] = node
        self.by_key.update(dict.fromkeys(head.keys, head))
        self.node_count += 1
        return head

    def split_at(self, path: list[TreeNode], position: int) -> None:
        """Make `position` a node boundary on `path` (which covers it)."""
        for i, node in enumerate(path):
            if node.start < position < node.end:
                path.insert(i, self.split(node, position - node.start))
                return

    # --- pages -----------------------------------------------------------------------
    def set_pages(
        self,
        node: TreeNode,
        tier: Tier,
        pool: PoolName,
        offsets: list[int],
        pages: Sequence[int],
        journal: Journal | None,
    ) -> None:
        """Give already-allocated pages to `node` at `offsets` (the tree now owns them)."""
        current = node.slots[tier][pool]
        if current is None and len(offsets) == node.n:  # a whole run, in order
            node.slots[tier][pool] = list(pages)
        else:
            if current is None:
                current = node.slots[tier][pool] = [ABSENT] * node.n
            for off, index in zip(offsets, pages):
                assert current[off] == ABSENT, (node, tier, pool, off)
                current[off] = index
        self._count(node, tier, pool, len(pages))
        if self.changes is not None:
            keys = node.keys
            self.changes.touched([keys[o] for o in offsets])
        if journal is not None:

            def undo() -> None:
                self.clear_pages(node, tier, pool, offsets)

            journal.record(undo)

    def drop_pages(
        self,
        node: TreeNode,
        tier: Tier,
        pool: PoolName,
        offsets: list[int],
        journal: Journal | None,
    ) -> list[int]:
        """Free `node`'s pages at `offsets` in (tier, pool) back to their allocator."""
        pages = self.clear_pages(node, tier, pool, offsets)
        self._free(pool, tier, pages)
        if journal is not None:

            def undo() -> None:
                self._take(pool, tier, pages)
                self.set_pages(node, tier, pool, offsets, pages, None)

            journal.record(undo)
            journal.dropped(pool, tier, pages)
        return pages

    def clear_pages(
        self, node: TreeNode, tier: Tier, pool: PoolName, offsets: list[int]
    ) -> list[int]:
        """Empty `node`'s slots at `offsets`; returns their pages, which stay taken."""
        current = node.pages_of(tier, pool)
        pages = [current[off] for off in offsets]
        assert ABSENT not in pages, (node, tier, pool, offsets)
        for off in offsets:
            current[off] = ABSENT
        if current.count(ABSENT) == len(current):
            node.slots[tier][pool] = None
        self._count(node, tier, pool, -len(pages))
        if self.changes is not None:
            keys = node.keys
            self.changes.touched([keys[o] for o in offsets])
        return pages

    def _count(self, node: TreeNode, tier: Tier, pool: PoolName, delta: int) -> None:
        self.owned[tier][pool] += delta
        if node.locks[pool]:
            self.protected[tier][pool] += delta

    # --- locks -----------------------------------------------------------------------
    def lock(self, nodes: list[TreeNode], pool: PoolName, delta: int) -> None:
        """Add `delta` (+1 or -1) to each node's lock on `pool`."""
        # Runs per node of every locked path (gets, evicting puts): index lists by a
        # plain int (an IntEnum index is slower) and count pages inline.
        at = int(pool)
        protected = self.protected
        for node in nodes:
            before = node.locks[at]
            after = before + delta
            if after < 0:
                raise RuntimeError(f"unlock of an unlocked node: {node}")
            node.locks[at] = after
            if (before == 0) != (after == 0):
                sign = 1 if after else -1
                for t, slots in enumerate(node.slots):
                    pages = slots[at]
                    if pages is not None:
                        protected[t][at] += sign * (len(pages) - pages.count(ABSENT))


def _none_if_empty(pages: list[int]) -> list[int] | None:
    return None if pages.count(ABSENT) == len(pages) else pages
