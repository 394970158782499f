"""The radix tree's nodes and hot primitives, pure Python: the reference for the C
extension `_radix` (csrc/nodes.c, nodes_tree.c, nodes_slots.c), which exports the same TreeNode
attributes and methods and the same functions with the same effects, in the same order.

RadixTree (radix.py) calls one of the two through these functions and keeps what
they leave out: the journal (undo), the change log and the node count. The functions
take the tree's containers explicitly (roots, by_first_key, the owned/protected counters),
so both implementations share one RadixTree.

Both refuse the same arguments the same way, before any change: offsets, positions, pages
and split counts that are not ints, keys that are not bytes, tiers and pools out of range
(a negative one would wrap), as the C side must, where another type's __index__ or __eq__
could run Python code mid-primitive (test_native_hostile.py).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

from .layout import PoolName, Tier

ABSENT = -1
TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)
# Read once, for hot paths: each `Tier.DEVICE` there is a Python-level enum lookup.
DEVICE = Tier.DEVICE
DEVICE_ONLY = (DEVICE,)

Counters = list[list[int]]  # [tier][pool]


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
        # [tier][pool]: a list of page indices, or None where the tier holds none
        self.slots: list[list[list[int] | None]] = [[None, None], [None, None], [None, None]]
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

    def page_has(self, offset: int, pool: PoolName, tiers: Sequence[Tier] = TIERS) -> bool:
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


# --- reading ---------------------------------------------------------------------------
def walk(
    roots: dict[bytes, TreeNode], root_key: bytes, raw: bytes, step: int
) -> tuple[list[TreeNode], int]:
    path: list[TreeNode] = []
    node = roots.get(root_key)
    off, end = 0, len(raw) - len(raw) % step
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
            and raw[off + k * step : off + (k + 1) * step] == node.tokens[k * step : (k + 1) * step]
        ):
            k += 1
        return path, node.start + k
    return path, off // step


def walk_keys(by_first_key: dict[bytes, TreeNode], keys: list[bytes]) -> tuple[list[TreeNode], int]:
    if not all(type(k) is bytes for k in keys):
        raise TypeError("keys must be bytes")
    path: list[TreeNode] = []
    i, total = 0, len(keys)
    while i < total:
        node = by_first_key.get(keys[i])
        if node is None:
            break
        # below a root first, then below the last node (so it starts at page i)
        if (node.parent is not path[-1]) if path else not node.up.is_root:
            break
        path.append(node)
        j, n = 1, node.n
        while j < n and i + j < total and node.keys[j] == keys[i + j]:
            j += 1
        i += j
        if j < n:
            break
    return path, i


def touch(nodes: Sequence[TreeNode], now: int, hit: bool) -> None:
    for node in nodes:
        node.last_access = now
        node.hits += hit


# --- structure -----------------------------------------------------------------------
def attach(
    parent: TreeNode,
    keys: list[bytes],
    tokens: bytes,
    step: int,
    by_first_key: dict[bytes, TreeNode],
    clock: int,
) -> TreeNode:
    if not keys:
        raise TypeError("attach needs a non-empty list of keys")
    node = TreeNode(keys, tokens, parent, parent.end)
    node.last_access = clock
    first, children = tokens[:step], parent.children
    before = children.get(first)
    children[first] = node
    try:
        by_first_key[keys[0]] = node
    except BaseException:  # whole or not at all: the parent's children as they were
        if before is None:
            del children[first]
        else:
            children[first] = before
        raise
    return node


def split(node: TreeNode, k: int, step: int, by_first_key: dict[bytes, TreeNode]) -> TreeNode:
    if type(k) is not int:
        raise TypeError("split needs an int count of pages")
    assert 0 < k < node.n, (node, k)
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
    by_first_key[head.keys[0]] = head
    by_first_key[node.keys[0]] = node
    return head


# --- pages and locks --------------------------------------------------------------------
def set_pages(
    node: TreeNode,
    tier: Tier,
    pool: PoolName,
    offsets: Sequence[int],
    pages: Sequence[int],
    owned: Counters,
    protected: Counters,
) -> None:
    _ints(offsets, "offsets")
    _ints(pages, "pages")
    current = _row(node, tier, pool)[pool]
    if current is None and len(offsets) == node.n:  # a whole run, in order
        node.slots[tier][pool] = list(pages)
    else:
        slot = [ABSENT] * node.n if current is None else current
        for off in offsets:  # every slot checked before any is written: all or nothing
            assert slot[off] == ABSENT, (node, tier, pool, off)
        for off, index in zip(offsets, pages):
            slot[off] = index
        if current is None:
            node.slots[tier][pool] = slot
    _count(node, tier, pool, len(pages), owned, protected)


def clear_pages(
    node: TreeNode,
    tier: Tier,
    pool: PoolName,
    offsets: Sequence[int],
    owned: Counters,
    protected: Counters,
) -> list[int]:
    _ints(offsets, "offsets")
    _row(node, tier, pool)
    current = node.pages_of(tier, pool)
    pages = [current[off] for off in offsets]
    assert ABSENT not in pages, (node, tier, pool, offsets)
    for off in offsets:
        current[off] = ABSENT
    if current.count(ABSENT) == len(current):
        node.slots[tier][pool] = None
    _count(node, tier, pool, -len(pages), owned, protected)
    return pages


def lock(nodes: Sequence[TreeNode], pool: PoolName, delta: int, protected: Counters) -> None:
    # Runs per node of every locked path (gets, evicting puts): index lists by a
    # plain int (an IntEnum index is slower) and count pages inline.
    at = int(pool)
    if type(delta) is not int:
        raise TypeError("a lock's delta must be an int")
    for node in nodes:  # a pool out of range: no change
        if not 0 <= at < len(node.locks):
            raise IndexError(f"no pool {at} in a TreeNode's locks")
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


# --- positions along a path ----------------------------------------------------------
def missing(
    path: Sequence[TreeNode], positions: Sequence[int], pool: PoolName, tiers: Sequence[Tier]
) -> list[int]:
    """Which of sorted `positions` have a page in `pool` on none of `tiers`: all past the path."""
    if type(positions) is not range:
        _ints(positions, "positions")
    out: list[int] = []
    i = 0
    for node in path:
        j = bisect_left(positions, node.end, i)
        if j > i:
            slots = [_row(node, t, pool)[pool] for t in tiers]
            if all(pages is None for pages in slots):
                out.extend(positions[i:j])
            elif not any(pages is not None and ABSENT not in pages for pages in slots):
                out.extend(
                    p for p in positions[i:j] if not node.page_has(p - node.start, pool, tiers)
                )
        i = j
    out.extend(positions[i:])  # past the path: new pages
    return out


Placement = tuple[PoolName, Sequence[int], Sequence[int]]  # (pool, sorted positions, pages)


def place_runs(
    nodes: Sequence[TreeNode],
    tier: Tier,
    placements: Sequence[Placement],
    owned: Counters,
    protected: Counters,
) -> list[tuple[TreeNode, PoolName, list[int]]]:
    """Give each placement's pages to the nodes (consecutive runs) holding its positions,
    as set_pages per node would: all or nothing (but for a set_pages that breaks off on a
    page already held, a bug). Returns (node, pool, offsets) per node given pages."""
    done: list[tuple[TreeNode, PoolName, list[int]]] = []
    try:
        for pool, positions, pages in placements:
            if type(positions) is not range:
                _ints(positions, "positions")
            if len(positions) != len(pages):
                raise ValueError(f"{len(positions)} positions for {len(pages)} pages")
            _check_rising(positions)
            i = 0
            for node in nodes:
                j = bisect_left(positions, node.end, i)
                if j == i:
                    continue
                offsets = []
                for p in positions[i:j]:
                    if not 0 <= p - node.start < node.n:
                        raise AssertionError(node, pool, p - node.start)
                    offsets.append(p - node.start)
                done.append((node, pool, offsets))
                try:
                    set_pages(node, tier, pool, offsets, pages[i:j], owned, protected)
                except BaseException:
                    done.pop()
                    raise
                i = j
            if i < len(positions):
                raise AssertionError("positions past the nodes", positions[i])
    except BaseException:
        for node, pool, offsets in reversed(done):
            clear_pages(node, tier, pool, offsets, owned, protected)
        raise
    return done


def grow(
    path: list[TreeNode],
    parent: TreeNode | None,
    keys: list[bytes],
    tokens: bytes,
    step: int,
    tier: Tier,
    placements: Sequence[Placement],
    by_first_key: dict[bytes, TreeNode],
    owned: Counters,
    protected: Counters,
    clock: int,
) -> tuple[list[TreeNode], list[tuple[TreeNode, PoolName, list[int]]]]:
    """`path`, then a new run of `keys` attached under `parent` (none for no keys), and each
    placement's pages given to the nodes holding its positions (place_runs): all or nothing,
    one call for RadixTree.grow. Returns (nodes, given), given as place_runs returns it:
    what an undo takes back before it detaches the new node (nodes[-1])."""
    if not (
        type(path) is list
        and type(keys) is list
        and type(tokens) is bytes
        and type(by_first_key) is dict
        and type(step) is int
        and type(clock) is int
    ):
        raise TypeError(
            "grow(list, parent, list, bytes, int, tier, placements, dict, owned, protected, int)"
        )
    if step <= 0:
        raise ValueError("grow's step must be > 0")
    if not all(type(k) is bytes for k in keys):
        raise TypeError("keys must be bytes")
    up = None  # the parent, where there is a run to attach
    if keys:
        if type(parent) is not TreeNode:
            raise TypeError(f"expected a TreeNode, got {type(parent).__name__}")
        up = parent
    nodes = list(path)
    node = None
    try:
        if up is not None:  # undone with the rest where any step fails
            node = attach(up, keys, tokens, step, by_first_key, clock)
            nodes.append(node)
        given = place_runs(nodes, tier, placements, owned, protected)
    except BaseException:
        if up is not None and node is not None:
            _unattach(up, node, tokens[:step], keys[0], by_first_key)
        raise
    return nodes, given


def _unattach(
    parent: TreeNode, node: TreeNode, first: bytes, key: bytes, by_first_key: dict[bytes, TreeNode]
) -> None:
    """grow's attach undone, where the maps still hold the node (a placement's code may
    have moved it)."""
    if parent.children.get(first) is node:
        del parent.children[first]
    if by_first_key.get(key) is node:
        del by_first_key[key]


def _ints(values: Sequence[int], what: str) -> None:
    """Ints only (not a subclass): as the C side, which must run no Python code mid-change."""
    if not all(type(v) is int for v in values):
        raise TypeError(f"{what} must be ints")


def _row(node: TreeNode, tier: Tier, pool: PoolName) -> list[list[int] | None]:
    """node.slots[tier], where `pool` is: an index out of range is an IndexError, not a
    negative index's wrap (C's messages)."""
    t, p = int(tier), int(pool)
    if not 0 <= t < len(node.slots):
        raise IndexError(f"no tier {t} in a TreeNode's slots")
    row = node.slots[t]
    if not 0 <= p < len(row):
        raise IndexError(f"no pool {p} in a TreeNode's slots")
    return row


def _check_rising(positions: Sequence[int]) -> None:
    """Positions must rise strictly: a repeated one would put two pages in one slot (one of
    them then owned by no one), and the node search assumes them sorted."""
    if type(positions) is range and positions.step > 0:
        return
    for k in range(1, len(positions)):
        if positions[k] <= positions[k - 1]:
            raise ValueError(f"positions must rise: {positions[k - 1]} then {positions[k]}")


def _count(
    node: TreeNode, tier: Tier, pool: PoolName, delta: int, owned: Counters, protected: Counters
) -> None:
    owned[tier][pool] += delta
    if node.locks[pool]:
        protected[tier][pool] += delta


def _none_if_empty(pages: list[int]) -> list[int] | None:
    return None if pages.count(ABSENT) == len(pages) else pages


def unlink(roots: dict[bytes, TreeNode]) -> None:
    """Break the parent <-> children cycles of a tree that goes away: no collection would,
    as the C nodes stay out of the garbage collector (issue #14). Every node loses its
    children and its parent, so each is then freed on its own, none through a chain. Nodes
    held elsewhere (a Match's path, a journal, the change log) stay valid objects, with no
    parent or children. Iterative: trees are deep."""
    stack = list(roots.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        node.children.clear()
        node.parent = None
