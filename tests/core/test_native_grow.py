"""The grow kernel (`_radix.grow`, csrc/nodes_tree.c) against its pure-Python twin
(nodes.grow), called directly on twin trees: an attach and every placement's pages in one
call. Placements that fail (pages already held, positions that do not rise or lie past the
nodes, counts that disagree) and failures injected while a placement's positions are read
(any exception type, at any placement, with or without code that moves the new node out of
the maps first) must give the same outcome on both sides and leave the tree as it was;
bad arguments are refused before any change. RadixTree.grow over both: test_native_radix.py;
insert_free over both, with its failures injected: test_native_insert.py."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.core.cache import nodes, radix
from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.radix import TIERS, RadixTree

from tests.core.test_native_hostile import ignore
from tests.core.test_native_radix import node_state, path_to, tree_state
from tests.examples import examples
from tests.inject import EXCEPTIONS

c_only = pytest.mark.skipif(
    not radix.ENABLED, reason="KVF_NATIVE=0 or not built: the reference alone"
)

STEP = 2


class Injected:
    """Positions whose reading raises `exc` (both sides read them once, by iterating),
    after `unmap` (if given) ran."""

    def __init__(self, positions, exc, unmap) -> None:
        self.positions, self.exc, self.unmap = list(positions), exc, unmap

    def __iter__(self):
        if self.unmap is not None:
            self.unmap()
            self.unmap = None
        if self.exc is not None:
            raise self.exc("injected at a placement")
        return iter(self.positions)

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, i):
        return self.positions[i]


def build(native: bool, runs: list[tuple[int, int]], held: list[tuple[int, int, int]]):
    """A tree of `runs` (parent index, pages) under one root, with pages at `held`
    (node index, offset, pool) on the device tier."""
    tree = RadixTree(STEP, ignore, ignore, native=native)
    made = [tree.root(b"r")]
    for k, (parent, pages) in enumerate(runs):
        up = made[parent % len(made)]
        tokens = b"".join((k * 8 + j + 1).to_bytes(STEP, "big") for j in range(pages))
        if tokens[:STEP] in up.children:
            continue
        made.append(tree.attach(up, [b"n%d.%d" % (k, j) for j in range(pages)], tokens, None))
    page = 1000
    for i, off, pool in held:
        node = made[1 + i % (len(made) - 1)] if len(made) > 1 else None
        if node is None or off >= node.n or node.page_has(off, pool, (Tier.DEVICE,)):
            continue
        tree.set_pages(node, Tier.DEVICE, pool, [off], [page], None)
        page += 1
    return tree, made


POSITIONS = st.lists(st.integers(-1, 12), max_size=5).flatmap(
    lambda xs: st.sampled_from([sorted(set(xs)), xs])
)


@c_only
@given(
    runs=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 3)), max_size=6),
    held=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 2), st.sampled_from(PoolName))),
    at=st.integers(0, 6),
    new=st.integers(0, 3),
    tier=st.sampled_from(TIERS),
    placements=st.lists(
        st.tuples(st.sampled_from(PoolName), POSITIONS, st.integers(-1, 1)), max_size=3
    ),
    inject=st.integers(-1, 2),
    exc=st.sampled_from(EXCEPTIONS),
    unmap=st.booleans(),
)
@settings(max_examples=examples(300), deadline=None)
def test_grow_matches_its_python_twin_and_fails_whole(
    runs, held, at, new, tier, placements, inject, exc, unmap
):
    outcomes, states = [], []
    for ops, on_c in ((radix.EXT, True), (nodes, False)):
        tree, made = build(on_c, runs, held)
        parent = made[at % len(made)]
        path = path_to(parent)
        keys = [b"g.%d" % j for j in range(new)]
        tokens = b"".join((900 + j).to_bytes(STEP, "big") for j in range(new))
        given_ = []
        for k, (pool, positions, short) in enumerate(placements):
            pages = [2000 + 10 * k + j for j in range(max(0, len(positions) + short))]
            if k == inject:

                def unmapping(parent=parent, tokens=tokens, keys=keys, tree=tree):
                    # code run mid-grow moves the new node out of the maps
                    parent.children.pop(tokens[:STEP], None)
                    if keys:
                        tree.by_first_key.pop(keys[0], None)

                positions = Injected(positions, exc, unmapping if unmap else None)
            given_.append((pool, positions, pages))
        before = tree_state(tree)
        try:
            grown, done = ops.grow(
                path, parent, keys, tokens, STEP, tier, given_,
                tree.by_first_key, tree.owned, tree.protected, 7,
            )  # fmt: skip
        except BaseException as e:  # noqa: B036 -- injected types include MemoryError
            outcomes.append(
                (type(e), str(e).split("\n")[0] if type(e) is not AssertionError else "")
            )
            assert tree_state(tree) == before  # nothing half done
            assert all(n.keys != keys for n in tree.nodes()) or not keys
        else:
            assert grown[: len(path)] == path
            outcomes.append(
                (
                    [node_state(n) for n in grown],
                    [(node_state(n), pool, offsets) for n, pool, offsets in done],
                )
            )
        states.append(tree_state(tree))
    assert outcomes[0] == outcomes[1]
    assert states[0] == states[1]


@pytest.mark.parametrize("ops", [pytest.param("native", id="c", marks=c_only), "python"])
def test_bad_arguments_are_refused_before_any_change(ops):
    kernel = radix.EXT if ops == "native" else nodes
    tree, made = build(ops == "native", [(0, 2)], [])
    root, node = made
    good = [
        [node], node, [b"a"], b"\0\1", STEP, Tier.DEVICE,
        [(PoolName.FULL, [2], [5])], tree.by_first_key, tree.owned, tree.protected, 3,
    ]  # fmt: skip
    bad = [
        (0, (node,), TypeError),
        (1, None, TypeError),
        (1, "node", TypeError),
        (2, (b"a",), TypeError),
        (2, ["a"], TypeError),
        (3, bytearray(b"\0\1"), TypeError),
        (4, 2.0, TypeError),
        (4, True, TypeError),
        (4, 0, ValueError),
        (7, {**tree.by_first_key}.items(), TypeError),
        (10, None, TypeError),
    ]
    before = tree_state(tree)
    for at, value, error in bad:
        args = list(good)
        args[at] = value
        with pytest.raises(error):
            kernel.grow(*args)
        assert tree_state(tree) == before, (at, value)
    with pytest.raises(TypeError):
        kernel.grow(*good[:10])
    grown, done = kernel.grow(*good)
    assert grown[:1] == [node] and grown[1].keys == [b"a"] and grown[1].last_access == 3
    assert done == [(grown[1], PoolName.FULL, [0])]
    assert tree.by_first_key[b"a"] is grown[1] and node.children[b"\0\1"] is grown[1]
    assert tree.owned[Tier.DEVICE][PoolName.FULL] == 1


@pytest.mark.parametrize("on_c", [pytest.param(True, marks=c_only), False])
def test_a_failed_grow_drops_the_empty_root_it_would_have_hung_from(on_c):
    """RadixTree.grow, its kernel failing: the new run never shows, and a namespace root
    left without children goes, as detach has it."""
    tree = RadixTree(STEP, ignore, ignore, native=on_c)
    root = tree.root(b"ns")
    with pytest.raises(ValueError, match="positions must rise"):
        tree.grow([], root, [b"a", b"b"], b"\0\1\0\2", Tier.DEVICE,
                  [(PoolName.FULL, [1, 0], [5, 6])], None)  # fmt: skip
    assert (tree.roots, tree.by_first_key, tree.node_count, tree.page_count) == ({}, {}, 0, 0)
    assert tree.owned[Tier.DEVICE] == [0, 0]
