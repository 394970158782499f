"""The radix tree over pages: one node per run of pages, one subtree per namespace.

A node holds a run of whole pages: their chained keys, their token bytes, and
per tier and pool a list of page indices (or None where the tier holds none
of the run's pages in that pool). Full KV moves between tiers a whole node at
a time; SWA pages can be tombstoned one by one (ABSENT in the list). Locks
are per node: a lock that ends inside a run splits the run first.

A node is found two ways: by walking children keyed by the first page's token
bytes (no hashing of a prefix already cached), or by its first page's chained key
(`by_first_key`, for peers and the index, which speak in keys: a chain of keys is
walked node by node, the rest of each run's keys compared in place, so the map
holds one key a node, not one a page). Every mutation goes
through the methods below, which keep the owned/protected page counters right
and, when a journal is given, record how to undo themselves.
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

from . import native, nodes
from .changes import ChangeLog
from .layout import PoolName, Tier
from .nodes import ABSENT, DEVICE, DEVICE_ONLY, TIERS, Placement, TreeNode
from .primitives import Allocator, Journal, Keyer, TreeOps, free_all

__all__ = [
    "ABSENT",
    "DEVICE",
    "DEVICE_ONLY",
    "TIERS",
    "ENABLED",
    "Journal",
    "Placement",
    "RadixTree",
    "TreeNode",
]


def _import() -> ModuleType:
    from . import _radix  # type: ignore[attr-defined]  # built C: mypy sees no source

    return _radix


T = TypeVar("T")
Reserved = dict[tuple[PoolName, Tier], list[int]]  # pages taken per (pool, tier)

EXT: ModuleType | None = native.load(native.MODE, _import)
ENABLED = EXT is not None


def placements(
    todo: Mapping[PoolName, Sequence[int]], tier: Tier, got: Reserved
) -> list[Placement]:
    """RadixTree.grow's placements: each pool's positions with the pages taken for them."""
    out: list[Placement] = []
    for pool, positions in todo.items():  # a loop: a comprehension costs a frame
        out.append((pool, positions, got[(pool, tier)]))
    return out


def tree_ops(native: bool | None = None) -> TreeOps:
    """The C primitives (native None or True) or the Python reference (False or no build)."""
    if native and EXT is None:
        raise RuntimeError("the native radix tree asked for, but its extension is not loaded")
    ops: TreeOps = EXT if EXT is not None and native is not False else nodes  # type: ignore[assignment]
    return ops


class RadixTree:
    """The tree. On the native side an instance is a _NativeRadixTree, whose fields live in
    C (`_radix.TreeState`) so that `insert_free` is one C call; the pure-Python tree keeps
    them as plain attributes. The same methods serve both."""

    def __new__(cls, *args: object, native: bool | None = None, **kwargs: object) -> "RadixTree":
        """The native tree or the Python one, as __init__'s `native` asks."""
        if cls is RadixTree and tree_ops(native) is not nodes:
            cls = _NativeRadixTree
        return super().__new__(cls)

    def __init__(
        self,
        page_bytes: int,
        free_page: Callable[[PoolName, Tier, list[int]], None],
        take_page: Callable[[PoolName, Tier, list[int]], None],
        *,
        native: bool | None = None,
    ) -> None:
        self.page_bytes = page_bytes
        self._free, self._take = free_page, take_page
        self._ops = tree_ops(native)  # C or the Python reference: same calls, same effects
        # missing is the primitive itself, bound here: a method would add only a frame a put
        self.missing = self._ops.missing  # type: ignore[method-assign,assignment]
        self.roots: dict[bytes, TreeNode] = {}  # namespace root key -> root
        self.by_first_key: dict[bytes, TreeNode] = {}  # a node's first page's key -> the node
        self.clock = 0
        self.node_count = 0
        self.page_count = 0  # pages (keys) along all runs
        self.version = 0  # bumped by every change of shape (attach, detach, split): walk_memo.py
        self.owned = [[0, 0] for _ in TIERS]  # [tier][pool] pages held by nodes
        self.protected = [[0, 0] for _ in TIERS]  # [tier][pool] pages held by locked nodes
        self.changes: ChangeLog | None = None  # with events on (an EventPublisher)
        # Nodes whose eviction groups may have changed since candidates.py last took them:
        # filled here, at every mutation, once it sets a set; None: untracked.
        self.dirty: set[TreeNode] | None = None
        # Both trees, one path: the Python nodes would be collected anyway. Not at exit,
        # where the process frees everything at once.
        weakref.finalize(self, nodes.unlink, self.roots).atexit = False

    @property
    def native(self) -> bool:
        return self._ops is not nodes

    # --- reading -----------------------------------------------------------------
    def walk(self, root_key: bytes, raw: bytes) -> tuple[list[TreeNode], int]:
        """Nodes along the whole pages of encoded tokens `raw`, and how many pages
        matched (the last node may match only part of its run)."""
        return self._ops.walk(self.roots, root_key, raw, self.page_bytes)

    def walk_keys(self, keys: list[bytes]) -> tuple[list[TreeNode], int]:
        """The same for a chain of page keys, up to the first key not held here."""
        return self._ops.walk_keys(self.by_first_key, keys)

    def missing(
        self, path: list[TreeNode], positions: Sequence[int], pool: PoolName, tiers: Sequence[Tier]
    ) -> list[int]:
        """Which of sorted `positions` have a page in `pool` on none of `tiers` along
        `path`: every position past it."""
        return self._ops.missing(path, positions, pool, tiers)

    def nodes(self) -> Iterator[TreeNode]:
        """Every page node, parents before children."""
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def page_keys(self) -> set[bytes]:
        """Every page's key (a walk over the tree)."""
        return {k for node in self.nodes() for k in node.keys}

    def touch(self, nodes: list[TreeNode], hit: bool = False) -> None:
        if self.dirty is not None:  # first: an op that breaks off midway changed some
            self.dirty.update(nodes)
        self.clock += 1
        self._ops.touch(nodes, self.clock, hit)

    # --- structure -----------------------------------------------------------------
    def root(self, root_key: bytes) -> TreeNode:
        node = self.roots.get(root_key)
        if node is None:
            node = self.roots[root_key] = self._ops.TreeNode([root_key], b"", None, 0)
        return node

    def attach(
        self, parent: TreeNode, keys: list[bytes], tokens: bytes, journal: Journal | None
    ) -> TreeNode:
        node = self._ops.attach(
            parent, keys, tokens, self.page_bytes, self.by_first_key, self.clock
        )
        self.node_count += 1
        self.page_count += len(keys)
        self.version += 1
        try:
            if self.dirty is not None:
                self.dirty.update((node, parent))
            if self.changes is not None:
                self.changes.touched(node, range(node.n))
        except BaseException:
            self.detach(node, None)  # whole or not at all, as every step here
            raise
        if journal is not None:
            journal.record(lambda: self.detach(node, None))
        return node

    def detach(self, node: TreeNode, journal: Journal | None) -> None:
        assert not node.children and not any(node.slots[t][p] for t in TIERS for p in PoolName), (
            node
        )
        parent = node.up
        del parent.children[node.tokens[: self.page_bytes]]
        del self.by_first_key[node.keys[0]]
        self.node_count -= 1
        self.page_count -= node.n
        self.version += 1
        self._drop_bare_root(parent)
        if journal is not None:  # before the records below, whatever they raise
            journal.record(lambda: self._reattach(node))
        if (dirty := self.dirty) is not None:
            dirty.update((node, parent))
            if len(dirty) > 2 * self.node_count + 1024:  # untaken for long: stop holding nodes
                self.dirty = None
        if self.changes is not None:
            self.changes.left(node)

    def _drop_bare_root(self, node: TreeNode) -> None:
        """A namespace root goes with its last child (`root` makes it again)."""
        if node.is_root and not node.children and self.roots.get(node.keys[0]) is node:
            del self.roots[node.keys[0]]

    def _reattach(self, node: TreeNode) -> None:
        if self.changes is not None:
            self.changes.touched(node, range(node.n))
        parent = node.up
        if parent.is_root:
            self.roots.setdefault(parent.keys[0], parent)
        parent.children[node.tokens[: self.page_bytes]] = node
        self.by_first_key[node.keys[0]] = node
        self.node_count += 1
        self.page_count += node.n
        self.version += 1
        if self.dirty is not None:
            self.dirty.update((node, parent))

    def split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut `node`'s run after its first k pages; returns the new head node.

        Structure only: pages, locks and the per-page view are unchanged, so
        splits need no undo."""
        head = self._ops.split(node, k, self.page_bytes, self.by_first_key)
        self.node_count += 1
        self.version += 1
        if self.dirty is not None:
            self.dirty.update((head, node))
        return head

    def split_at(self, path: list[TreeNode], position: int) -> None:
        """Make `position` a node boundary on `path` (which covers it)."""
        for i, node in enumerate(path):
            if node.start < position < node.end:
                path.insert(i, self.split(node, position - node.start))
                return

    def grow(
        self,
        path: list[TreeNode],
        parent: TreeNode | None,
        keys: list[bytes],
        tokens: bytes,
        tier: Tier,
        placements: Sequence[Placement],
        journal: Journal | None,
    ) -> list[TreeNode]:
        """`path`, then a new run of `keys` and `tokens` under `parent` (none when `keys` is
        empty), with each placement's (pool, sorted positions, pages) given on `tier` to
        the nodes holding its positions; all or nothing. Returns the nodes."""
        nodes, given = self._grow(path, parent, keys, tokens, tier, placements, False)
        if journal is not None:
            node = nodes[-1] if keys else None
            journal.record(lambda: self._ungrow(tier, given, node))
        return nodes

    def _grow(
        self,
        path: list[TreeNode],
        parent: TreeNode | None,
        keys: list[bytes],
        tokens: bytes,
        tier: Tier,
        placements: Sequence[Placement],
        touch: bool,
    ) -> tuple[list[TreeNode], list[tuple[TreeNode, PoolName, list[int]]]]:
        """grow without a journal: (nodes, what the placements gave), whole or not at all.
        The tree's work is one call (`_ops.grow`); the counts, dirty set and change log are
        kept here. With `touch`, the nodes are touched after, as touch(nodes) does."""
        now = self.clock + 1 if touch else self.clock
        try:
            nodes, given = self._ops.grow(
                path, parent, keys, tokens, self.page_bytes, tier, placements,
                self.by_first_key, self.owned, self.protected, now,
            )  # fmt: skip
        except BaseException:
            # As after a detach, a namespace root left without children goes (read only
            # where the kernel's checks could pass: no Python code runs here).
            if type(keys) is list and keys and parent is not None:
                if type(parent) is self._ops.TreeNode:
                    self._drop_bare_root(parent)
            raise
        node = nodes[-1] if keys else None
        if node is not None:
            self.node_count += 1
            self.page_count += len(keys)
            self.version += 1
        try:
            if (dirty := self.dirty) is not None:
                if node is not None:
                    dirty.update((node, node.up))
                if touch:
                    dirty.update(nodes)
                for x, _, _ in given:  # a loop: a generator costs a frame per insert
                    dirty.add(x)
            if (changes := self.changes) is not None:
                if node is not None:
                    changes.touched(node, range(node.n))
                for x, _, offsets in given:
                    changes.touched(x, offsets)
        except BaseException:
            self._ungrow(tier, given, node)  # whole or not at all, as every step here
            raise
        if touch:  # last: nothing after it can fail, so nothing has to restore it
            self.clock = now
            self._ops.touch(nodes, now, False)
        return nodes, given

    def _ungrow(
        self,
        tier: Tier,
        given: list[tuple[TreeNode, PoolName, list[int]]],
        node: TreeNode | None,
    ) -> None:
        """grow's undo: the pages it gave taken back, newest first, then its node detached."""
        for x, pool, offsets in reversed(given):
            self.clear_pages(x, tier, pool, offsets)
        if node is not None:
            self.detach(node, None)

    def new_run(
        self, path: list[TreeNode], tokens: bytes, keyer: Keyer
    ) -> tuple[TreeNode | None, list[bytes]]:
        """The parent and keys of a new run of `tokens` below `path`'s end (none for no
        tokens): keys chain from the parent's last key, whatever position it ends at."""
        if not tokens:
            return None, []
        parent = path[-1] if path else self.root(keyer.root)
        return parent, keyer.chain(tokens, parent.keys[-1])

    def insert_free(
        self,
        path: list[TreeNode],
        tokens: bytes,
        keyer: Keyer,
        todo: Mapping[PoolName, Sequence[int]],
        tier: Tier,
        allocators: Mapping[PoolName, Allocator],
        hook: Callable[[PoolName, Tier], None] | None,
        fill: Callable[[Reserved, Any], T | None] | None,
        quarantine: Callable[[], None] | None,
        got: Reserved,
    ) -> tuple[list[TreeNode], T | None] | None:
        """An insert on free pages, the common case, whole or not at all; the native tree
        does it in one C call (csrc/radix_insert.c, over the same grow kernel). None, with
        nothing done, where an allocator lacks the free pages `todo` (positions per pool)
        asks of it. Otherwise: take them into `got` (calling `hook(pool, tier)` first, as a
        reservation does), `fill(got, quarantine)` them, grow the tree by the run of `tokens`
        below the path's end (keys chained by `keyer`) with each pool's pages at its
        positions, and touch the nodes. Returns
        (nodes, None), or ([], failure) where fill returns one; on a failure or an
        exception the tree is as before and the pages left in `got` are freed (quarantine()
        empties it first where a transfer may still write them)."""
        for pool, positions in todo.items():  # loops: a comprehension costs a frame
            if allocators[pool].free_count < len(positions):
                return None
        try:
            for pool, positions in todo.items():
                if hook is not None and positions:
                    hook(pool, tier)
                got[(pool, tier)] = allocators[pool].alloc(len(positions))
            if fill is not None and (failed := fill(got, quarantine)) is not None:
                return [], failed
            parent, keys = self.new_run(path, tokens, keyer)
            given = placements(todo, tier, got)
            # whole or not at all, and the last step that can fail: no undo to keep
            nodes, _ = self._grow(path, parent, keys, tokens, tier, given, True)
            got.clear()  # placed: the tree owns them now
            return nodes, None
        finally:
            free_all(got, allocators)

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
        if self.dirty is not None:
            self.dirty.add(node)
        self._ops.set_pages(node, tier, pool, offsets, pages, self.owned, self.protected)
        if self.changes is not None:
            self.changes.touched(node, offsets)
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
        if self.dirty is not None:
            self.dirty.add(node)
        pages = self._ops.clear_pages(node, tier, pool, offsets, self.owned, self.protected)
        if self.changes is not None:
            self.changes.touched(node, offsets)
        return pages

    # --- locks -----------------------------------------------------------------------
    def lock(self, nodes: list[TreeNode], pool: PoolName, delta: int) -> None:
        """Add `delta` (+1 or -1) to each node's lock on `pool`."""
        if self.dirty is not None:
            self.dirty.update(nodes)
        self._ops.lock(nodes, pool, delta, self.protected)


if EXT is not None:
    _TreeState: Any = EXT.TreeState  # built C: mypy sees no source

    class _NativeRadixTree(RadixTree, _TreeState):
        """RadixTree with its fields in C, where a request's calls are one C call each:
        walk and insert_free on the state (missing, the primitive itself, is bound by
        __init__ on both trees)."""

        walk = _TreeState.walk
        insert_free = _TreeState.insert_free
