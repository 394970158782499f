"""The radix tree's two implementations, C (`_radix`) and the pure-Python reference
(nodes.py), driven through the same random operations: every RadixTree primitive on
twin trees (attach, split, set_pages, clear_pages, drop_pages and grow with undo, lock,
touch, walk, walk_keys, missing, detach). Results, errors and whole-tree state must agree exactly.
Whole caches on both trees: test_native_cache_twins.py. tests/core runs on both
through KVF_NATIVE."""

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kvfabric.core.cache import nodes, radix
from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.radix import ABSENT, TIERS, RadixTree

from tests.examples import examples

pytestmark = pytest.mark.skipif(
    not radix.ENABLED, reason="KVF_NATIVE=0 or not built: the reference alone"
)

STEP = 2  # bytes a page: small, so runs share pages often


def node_state(node) -> tuple:
    return (
        tuple(node.keys),
        node.tokens,
        node.start,
        node.end,
        None if node.parent is None else node.parent.keys[-1],
        tuple(tuple(None if p is None else tuple(p) for p in row) for row in node.slots),
        tuple(node.locks),
        node.last_access,
        node.hits,
        sorted(node.children),
        repr(node),
        node.n,
        node.is_root,
    )


def tree_state(tree: RadixTree) -> tuple:
    return (
        sorted(node_state(n) for n in tree.nodes()),
        sorted((k, node_state(r)) for k, r in tree.roots.items()),
        sorted((k, n.keys[0], n.start) for k, n in tree.by_first_key.items()),
        tree.page_count,
        tree.owned,
        tree.protected,
        tree.clock,
        tree.node_count,
    )


def outcome(fn):
    try:
        out = fn()
    except (AssertionError, RuntimeError, IndexError, KeyError, TypeError, ValueError) as e:
        return type(e), str(e).split("\n")[0]  # pytest appends its rewrite to assertions
    if isinstance(out, tuple) and out and isinstance(out[0], list):  # a walk: (path, pages)
        return [node_state(n) for n in out[0]], out[1]
    return node_state(out) if hasattr(out, "slots") else out


def path_to(node) -> list:
    """The nodes from below the namespace root down to `node` (none for a root)."""
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    return path[::-1]


# Positions as plans draw them (sorted) and as they should never come (unsorted, past runs).
# Sorted, unsorted, and ranges (any step: the C side reads a range of step 1 from its bounds).
POSITIONS = st.one_of(
    st.lists(st.integers(-2, 14), max_size=6).flatmap(
        lambda xs: st.sampled_from([sorted(set(xs)), xs])
    ),
    st.builds(range, st.integers(-2, 14), st.integers(-2, 16), st.sampled_from([1, 1, 2, -1])),
)


class Journal:
    def __init__(self) -> None:
        self.undos: list = []
        self.freed: list = []

    def record(self, undo) -> None:
        self.undos.append(undo)

    def dropped(self, pool, tier, pages) -> None:
        self.freed.append((pool, tier, list(pages)))


# What set_pages and drop_pages draw: a node, where, which offsets, and whether to undo.
PAGE_STEP = dict(
    i=st.integers(0, 40),
    tier=st.sampled_from(TIERS),
    pool=st.sampled_from(PoolName),
    offsets=st.lists(st.integers(0, 4), max_size=4, unique=True),
    undo=st.booleans(),
)


class TwinTrees(RuleBasedStateMachine):
    """Node i of `self.nodes[0]` (C) and of `self.nodes[1]` (Python) were made by the same call."""

    @initialize()
    def setup(self):
        self.log: list[list] = [[], []]
        self.trees = [
            RadixTree(STEP, self._record(s, "free"), self._record(s, "take"), native=native)
            for s, native in ((0, True), (1, False))
        ]
        assert [t.native for t in self.trees] == [True, False]
        self.nodes: list[list] = [[t.root(b"r0"), t.root(b"r1")] for t in self.trees]
        self.next = 0

    def _record(self, side, what):
        return lambda pool, tier, pages: self.log[side].append((what, pool, tier, list(pages)))

    def both(self, call):
        """Run call(tree, nodes) on both trees; their outcomes must be equal."""
        a, b = (outcome(lambda s=s: call(self.trees[s], self.nodes[s])) for s in (0, 1))
        assert a == b
        return a

    @rule(parent=st.integers(0, 40), pages=st.integers(1, 4), data=st.data())
    def attach(self, parent, pages, data):
        tails = data.draw(st.lists(st.integers(0, 2), min_size=pages - 1, max_size=pages - 1))
        self.next += 1
        first = self.next.to_bytes(STEP, "big")
        tokens = first + b"".join(t.to_bytes(STEP, "big") for t in tails)
        keys = [b"k%d.%d" % (self.next, j) for j in range(pages)]

        def call(tree, nodes):
            node = tree.attach(nodes[parent % len(nodes)], list(keys), tokens, None)
            nodes.append(node)
            return node

        self.both(call)

    def _node(self, i: int, side: int):
        return self.nodes[side][i % len(self.nodes[side])]

    @rule(i=st.integers(0, 40), k=st.integers(-1, 4))
    def split(self, i, k):
        def call(tree, nodes):
            head = tree.split(nodes[i % len(nodes)], k)
            nodes.append(head)
            return head

        self.both(call)

    @rule(**PAGE_STEP)
    def set_pages(self, i, tier, pool, offsets, undo):
        self.next += 1
        pages = [self.next * 10 + j for j in range(len(offsets))]
        journals = [Journal(), Journal()]

        def call(tree, nodes):
            side = 0 if tree is self.trees[0] else 1
            return tree.set_pages(nodes[i % len(nodes)], tier, pool, offsets, pages, journals[side])

        if self.both(call) is None and undo:
            self.both(
                lambda tree, nodes: [u() for u in reversed(journals[tree is self.trees[1]].undos)]
            )

    @rule(**PAGE_STEP)
    def drop_pages(self, i, tier, pool, offsets, undo):
        journals = [Journal(), Journal()]

        def call(tree, nodes):
            side = 0 if tree is self.trees[0] else 1
            return tree.drop_pages(nodes[i % len(nodes)], tier, pool, offsets, journals[side])

        self.both(call)
        assert journals[0].freed == journals[1].freed
        if undo:
            self.both(
                lambda tree, nodes: [u() for u in reversed(journals[tree is self.trees[1]].undos)]
            )

    @rule(
        picks=st.lists(st.integers(0, 40), max_size=4),
        pool=st.sampled_from(PoolName),
        delta=st.sampled_from([1, 1, -1]),
    )
    def lock(self, picks, pool, delta):
        self.both(
            lambda tree, nodes: tree.lock([nodes[i % len(nodes)] for i in picks], pool, delta)
        )

    @rule(picks=st.lists(st.integers(0, 40), max_size=4), hit=st.booleans())
    def touch(self, picks, hit):
        self.both(lambda tree, nodes: tree.touch([nodes[i % len(nodes)] for i in picks], hit))

    @rule(
        i=st.integers(0, 40),
        cut=st.integers(0, 12),
        noise=st.binary(max_size=5),
        root=st.sampled_from([b"r0", b"r1", b"nope"]),
    )
    def walk(self, i, cut, noise, root):
        def call(tree, nodes):
            node, run = nodes[i % len(nodes)], b""
            while node.parent is not None:
                run, node = node.tokens + run, node.parent
            return tree.walk(root, run[: max(0, len(run) - cut)] + noise)

        self.both(call)

    @rule(
        i=st.integers(0, 40),
        cut=st.integers(0, 6),
        swap=st.integers(-1, 8),
        other=st.integers(-1, 40),
    )
    def walk_keys(self, i, cut, swap, other):
        def call(tree, nodes):
            node, keys = nodes[i % len(nodes)], []
            while node.parent is not None:
                keys, node = node.keys + keys, node.parent
            keys = keys[: max(0, len(keys) - cut)]
            if 0 <= swap < len(keys):  # a stranger, or another node's first key
                keys[swap] = b"stranger" if other < 0 else nodes[other % len(nodes)].keys[0]
            return tree.walk_keys(keys)

        self.both(call)

    @rule(
        i=st.integers(0, 40),
        pages=st.integers(0, 3),
        tier=st.sampled_from(TIERS),
        placements=st.lists(st.tuples(st.sampled_from(PoolName), POSITIONS), max_size=2),
        short=st.booleans(),
        undo=st.booleans(),
    )
    def grow(self, i, pages, tier, placements, short, undo):
        self.next += 1
        keys = [b"g%d.%d" % (self.next, j) for j in range(pages)]
        tokens = self.next.to_bytes(STEP, "big") * pages
        given = [
            (pool, pos, [self.next * 100 + 10 * k + j for j in range(len(pos) - short * (k == 0))])
            for k, (pool, pos) in enumerate(placements)
        ]
        journals = [Journal(), Journal()]

        def call(tree, nodes):
            side = 0 if tree is self.trees[0] else 1
            node = nodes[i % len(nodes)]
            path = path_to(node)
            try:
                out = tree.grow(path, node, keys, tokens, tier, given, journals[side])
            except AssertionError:
                # Its message names the node, whose repr changes as grow undoes itself: under
                # pytest (which rewrites kvfabric's asserts, its plugin's package) the Python
                # side formats it before the undo, the C side after. Type and state must agree.
                return AssertionError
            nodes.extend(out[len(path) :])
            return [node_state(n) for n in out]

        if isinstance(self.both(call), list) and undo:
            self.both(
                lambda tree, nodes: [u() for u in reversed(journals[tree is self.trees[1]].undos)]
            )

    @rule(
        i=st.integers(0, 40),
        positions=POSITIONS,
        pool=st.sampled_from(PoolName),
        tiers=st.sampled_from([TIERS, (Tier.DEVICE,), (Tier.HOST,), ()]),
    )
    def missing(self, i, positions, pool, tiers):
        self.both(
            lambda tree, nodes: tree.missing(path_to(nodes[i % len(nodes)]), positions, pool, tiers)
        )

    @rule(i=st.integers(0, 40))
    def detach(self, i):
        self.both(lambda tree, nodes: tree.detach(nodes[i % len(nodes)], None))

    @invariant()
    def same_state(self):
        if hasattr(self, "trees"):
            assert tree_state(self.trees[0]) == tree_state(self.trees[1])
            assert self.log[0] == self.log[1]


TestTwinTrees = TwinTrees.TestCase
TestTwinTrees.settings = settings(max_examples=examples(300), stateful_step_count=60, deadline=None)


def test_node_fields_are_checked_and_a_bad_store_changes_nothing():
    node = radix.EXT.TreeNode([b"k"], b"ab", None, 0)
    for name, bad in [
        ("keys", (b"k",)),
        ("tokens", "ab"),
        ("parent", 3),
        ("children", []),
        ("slots", None),
        ("locks", (0, 0)),
    ]:
        before = getattr(node, name)
        with pytest.raises(TypeError, match=f"TreeNode.{name} must be"):
            setattr(node, name, bad)
        assert getattr(node, name) is before
    with pytest.raises(TypeError):
        radix.EXT.TreeNode("k", b"ab", None, 0)
    with pytest.raises(TypeError, match="native TreeNode"):
        radix.EXT.walk_keys({b"k": nodes.TreeNode([b"k"], b"ab", None, 0)}, [b"k"])


def test_node_methods_match_the_reference():
    made = []
    for ops in (radix.EXT, nodes):
        root = ops.TreeNode([b"r"], b"", None, 0)
        node = ops.TreeNode([b"a", b"b", b"c"], b"xxyyzz", root, 0)
        node.slots[Tier.HOST][PoolName.SWA] = [ABSENT, 7, ABSENT]
        made.append((node, root))
    for (c, croot), (p, proot) in [made]:
        assert (c.n, c.end, c.is_root, c.up is croot, croot.n, croot.end) == (
            p.n,
            p.end,
            p.is_root,
            p.up is proot,
            proot.n,
            proot.end,
        )
        for pool in PoolName:
            for tiers in (TIERS, (Tier.DEVICE,), (Tier.HOST,)):
                assert c.has(pool, tiers) == p.has(pool, tiers)
                for off in (0, 1, -1):
                    assert c.page_has(off, pool, tiers) == p.page_has(off, pool, tiers)
            assert c.has(pool) == p.has(pool)
            for tier in TIERS:
                assert c.count(tier, pool) == p.count(tier, pool)
        assert c.pages_of(Tier.HOST, PoolName.SWA) == p.pages_of(Tier.HOST, PoolName.SWA)
        for n in (c, p):
            with pytest.raises(AssertionError):
                n.pages_of(Tier.DEVICE, PoolName.FULL)
        with pytest.raises(AssertionError, match="no parent"):
            croot.up
        assert repr(c) == repr(p)


def test_asking_for_the_native_tree_without_the_extension_is_an_error():
    with mock.patch.object(radix, "EXT", None):
        with pytest.raises(RuntimeError, match="not loaded"):
            RadixTree(4, print, print, native=True)
        assert not RadixTree(4, print, print).native
    assert RadixTree(4, print, print).native and not RadixTree(4, print, print, native=False).native


@settings(max_examples=examples(300), deadline=None)
@given(
    runs=st.lists(
        st.tuples(
            st.integers(1, 4),
            st.lists(st.one_of(st.none(), st.lists(st.sampled_from([ABSENT, 5]))), max_size=4),
        ),
        min_size=1,
        max_size=3,
    ),
    positions=POSITIONS,
    pool=st.sampled_from(PoolName),
    tiers=st.sampled_from([TIERS, (Tier.DEVICE,), (Tier.HOST,), ()]),
)
def test_missing_agrees_on_any_slots(runs, positions, pool, tiers):
    """missing over a path whose runs hold whole, partial (SWA tombstones) or no page lists."""
    answers = []
    for ops in (radix.EXT, nodes):
        path, parent, start = [], ops.TreeNode([b"r"], b"", None, 0), 0
        for n, lists in runs:
            node = ops.TreeNode([b"k%d" % (start + j) for j in range(n)], b"", parent, start)
            for cell, pages in enumerate(lists):
                node.slots[cell // 2][cell % 2] = None if pages is None else (pages * n)[:n]
            path.append(node)
            parent, start = node, start + n
        answers.append(outcome(lambda: ops.missing(path, positions, pool, tiers)))
    assert answers[0] == answers[1]
