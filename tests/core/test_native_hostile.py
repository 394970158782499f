"""The C tree primitives (`_radix`) under hostile callers: arguments whose `__index__` or
`__eq__` runs Python code that replaces a node's lists mid-call, negative and
overflowing sizes, a hook that replaces what it was handed. Each is called on twin trees,
C and the pure-Python reference: both raise the same error and change nothing (the tree,
its counters and its allocators as before). Run under AddressSanitizer and UBSan by
`make sanitize` (which `make test` calls): there, a primitive that reads or writes memory
it does not own fails the run, not only a wrong answer."""

import pytest
from kvfabric.core.cache import radix
from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.radix import RadixTree

from tests.core.test_native_radix import outcome as result
from tests.core.test_native_radix import tree_state

pytestmark = pytest.mark.skipif(
    not radix.ENABLED, reason="KVF_NATIVE=0 or not built: the reference alone"
)

STEP = 2
FULL, SWA = PoolName.FULL, PoolName.SWA
DEVICE, HOST = Tier.DEVICE, Tier.HOST


def outcome(fn):
    """What `fn` returns (as test_native_radix compares it), or the type and first line of
    any exception it raises (MemoryError included)."""
    try:
        return result(fn)
    except Exception as e:
        return type(e), str(e).split("\n")[0]


def ignore(pool, tier, pages) -> None:
    """The tree's page hooks (free_page, take_page): nothing to do here."""


class Twins:
    """A C tree and a Python tree built alike: a root and a node of 4 pages with FULL
    pages on both tiers and SWA pages on the device."""

    def __init__(self) -> None:
        self.trees = [RadixTree(STEP, ignore, ignore, native=n) for n in (True, False)]
        self.nodes = []
        for tree in self.trees:
            root = tree.root(b"root-key")
            node = tree.attach(root, [b"k0", b"k1", b"k2", b"k3"], b"aabbccdd", None)
            tree.set_pages(node, DEVICE, FULL, [0, 1, 2, 3], [10, 11, 12, 13], None)
            tree.set_pages(node, HOST, FULL, [0, 1, 2, 3], [20, 21, 22, 23], None)
            tree.set_pages(node, DEVICE, SWA, [2, 3], [30, 31], None)
            self.nodes.append(node)

    def both(self, call) -> tuple:
        """call(tree, node) on each: the same outcome, and no change where it raised."""
        before = [tree_state(t) for t in self.trees]
        got = [outcome(lambda s=s: call(self.trees[s], self.nodes[s])) for s in (0, 1)]
        assert got[0] == got[1], got
        if isinstance(got[0], tuple) and isinstance(got[0][0], type):  # raised
            assert [tree_state(t) for t in self.trees] == before
        return got[0]


class Replacer:
    """An index or a key whose use replaces the node's lists (slots, keys, a tier's row)."""

    def __init__(self, node, value, eq: bool = False) -> None:
        self.node, self.value, self.eq = node, value, eq

    def _strike(self) -> None:
        node = self.node
        node.slots = [[None, None], [None, None]]
        node.keys = [b"x"]
        node.locks = [0]

    def __index__(self) -> int:
        self._strike()
        return self.value

    def __eq__(self, other) -> bool:
        self._strike()
        return self.value == other

    def __hash__(self) -> int:
        return hash(self.value)


class Unhashable:
    """A page key whose hashing raises `error` (a dict insert that fails, as on memory)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __hash__(self) -> int:
        raise self.error


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("x"), KeyboardInterrupt()])
@pytest.mark.parametrize("tokens", [b"ee", b"aa"])  # a new first page, or the child's own
def test_an_attach_whose_key_cannot_be_indexed_leaves_the_parent_as_it_was(error, tokens):
    """The child goes into its parent, then its first key into the tree's key map: when
    the second fails, the first is undone (and a child it displaced put back)."""
    twins = Twins()
    for tree in twins.trees:
        root = tree.root(b"root-key")
        held = dict(root.children)
        with pytest.raises(type(error)):
            tree.attach(root, [Unhashable(error)], tokens, None)
        assert root.children == held
    assert tree_state(twins.trees[0]) == tree_state(twins.trees[1])


def test_a_walk_on_a_tree_never_initialised_is_refused():
    """The native tree's walk reads its roots in C: before __init__ sets them, an error."""
    tree = RadixTree.__new__(RadixTree, native=True)
    with pytest.raises(TypeError):
        tree.walk(b"root", bytes(STEP))


def test_a_huge_range_of_positions_is_refused():
    """8 bytes a position times 2**62 wraps a size_t: C refused it as Python does."""
    twins = Twins()
    got = twins.both(lambda t, n: t.missing([n], range(1 << 62), FULL, (DEVICE,)))
    assert got[0] is MemoryError


@pytest.mark.parametrize("pool", [-1, -2, 2, 1 << 40])
def test_a_pool_out_of_range_changes_no_lock(pool):
    twins = Twins()
    got = twins.both(lambda t, n: t.lock([n], pool, 1))
    assert got[0] is IndexError


@pytest.mark.parametrize("tier", [-1, 3])
def test_a_tier_out_of_range_gives_no_page(tier):
    twins = Twins()
    got = twins.both(lambda t, n: t.set_pages(n, tier, FULL, [0], [99], None))
    assert got[0] is IndexError


def test_offsets_that_replace_the_nodes_lists_are_refused():
    twins = Twins()
    got = twins.both(lambda t, n: t.set_pages(n, HOST, SWA, [Replacer(n, 0)], [99], None))
    assert got[0] is TypeError


def test_positions_that_replace_the_nodes_lists_are_refused():
    twins = Twins()
    got = twins.both(lambda t, n: t.missing([n], [Replacer(n, 1)], FULL, (DEVICE, HOST)))
    assert got[0] is TypeError


def test_a_key_that_replaces_the_nodes_keys_is_refused():
    twins = Twins()
    got = twins.both(lambda t, n: t.walk_keys([b"k0", Replacer(n, b"k1", eq=True)]))
    assert got[0] is TypeError


def test_a_split_count_that_replaces_the_nodes_lists_is_refused():
    twins = Twins()
    got = twins.both(lambda t, n: t.split(n, Replacer(n, 2)))
    assert got[0] is TypeError


def test_pages_planted_in_a_node_are_never_run():
    """A page list holding something other than ints (planted by hand: the tree never
    stores one) is refused where a C primitive meets it, with no Python code of it run and
    nothing changed. (The reference trusts its own state: what it does with a planted
    object is Python's business, not a memory error, so it is not compared here.)"""
    tree = RadixTree(STEP, ignore, ignore, native=True)
    root = tree.root(b"root-key")
    node = tree.attach(root, [b"k0", b"k1", b"k2", b"k3"], b"aabbccdd", None)
    tree.set_pages(node, DEVICE, FULL, [0, 1, 2, 3], [10, 11, 12, 13], None)
    planted = Replacer(node, -1, eq=True)
    node.slots[HOST][SWA] = [planted, -1, -1, -1]
    before = tree_state(tree)
    for call in (
        lambda: tree.split(node, 2),
        lambda: tree.missing([node], [0, 1], SWA, (HOST,)),
        lambda: tree.set_pages(node, HOST, SWA, [0], [99], None),
        lambda: tree.lock([node], SWA, 1),
        lambda: node.count(HOST, SWA),
        lambda: node.page_has(0, SWA, (HOST,)),
    ):
        with pytest.raises(TypeError, match="pages must be ints"):
            call()
        assert node.keys == [b"k0", b"k1", b"k2", b"k3"]  # the planted object never ran
        assert tree_state(tree) == before


def test_a_hook_that_replaces_the_todo_lists_gets_pages_for_what_it_was_handed():
    """insert_free's reservation hook replaces `todo[pool]` (and the position list it was
    handed) while the insert takes pages: the pages taken are sized from the lists as the
    insert read them, and what the insert places is refused whole where they disagree."""
    from kvfabric.core.cache.allocator import PageAllocator
    from kvfabric.core.cache.keys import PageKeyer

    outcomes = []
    for tree in (RadixTree(STEP, ignore, ignore, native=n) for n in (True, False)):
        todo = {FULL: [0, 1, 2], SWA: [1, 2]}
        allocators = {FULL: PageAllocator(8), SWA: PageAllocator(8)}

        def hook(pool, tier, todo=todo):
            todo[FULL] = [0]  # a shorter list than the pages taken for it
            todo[SWA].clear()

        keyer = PageKeyer("ns", b"f" * 16, 1)
        got: dict = {}
        outcomes.append(
            outcome(
                lambda tree=tree, todo=todo, allocators=allocators, hook=hook, got=got: (
                    tree.insert_free(
                        [], b"aabbcc", keyer, todo, DEVICE, allocators, hook, None, None, got
                    )
                )
            )
        )
        outcomes.append((tree.node_count, [a.free_count for a in allocators.values()], got))
    assert outcomes[0] == outcomes[2] and outcomes[1] == outcomes[3], outcomes
    assert outcomes[0][0] is ValueError  # three pages for one position: refused whole
    assert outcomes[1][:2] == (0, [8, 8])  # nothing placed, every page back


def test_a_hook_that_adds_to_todo_stops_the_insert_as_a_python_loop_would():
    from kvfabric.core.cache.allocator import PageAllocator
    from kvfabric.core.cache.keys import PageKeyer

    outcomes = []
    for tree in (RadixTree(STEP, ignore, ignore, native=n) for n in (True, False)):
        todo = {FULL: [0, 1, 2]}
        allocators = {FULL: PageAllocator(8), SWA: PageAllocator(8)}

        def hook(pool, tier, todo=todo):
            todo[SWA] = [0]

        got: dict = {}
        outcomes.append(
            outcome(
                lambda tree=tree, todo=todo, allocators=allocators, hook=hook, got=got: (
                    tree.insert_free(
                        [],
                        b"aabbcc",
                        PageKeyer("ns", b"f" * 16, 1),
                        todo,
                        DEVICE,
                        allocators,
                        hook,
                        None,
                        None,
                        got,
                    )
                )
            )
        )
        outcomes.append((tree.node_count, [a.free_count for a in allocators.values()]))
    assert outcomes[0] == outcomes[2] == (RuntimeError, "dictionary changed size during iteration")
    assert outcomes[1] == outcomes[3] == (0, [8, 8])
