"""RadixTree.insert_free, one C call on the native tree (csrc/radix_insert.c), against its
pure-Python reference, on twin trees driven through the same random inserts. A failure is
injected at any call it makes out (the reservation hook, an allocator's free_count, alloc
and free, the fill, the keyer's chain, the change log's touched and left), with any
exception type, and positions that do not rise are given. Outcomes, whole-tree state,
allocators, `got`, the change log and the dirty set must agree exactly; an insert that
fails, raises or finds no room leaves the tree and the allocators as they were (but for
pages its fill held, and those a failing free did not take back)."""

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule
from kvfabric.core.cache import radix
from kvfabric.core.cache.allocator import PageAllocator
from kvfabric.core.cache.changes import ChangeLog
from kvfabric.core.cache.keys import PageKeyer, encode_tokens
from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.radix import RadixTree

from tests.core.test_native_radix import node_state, tree_state
from tests.examples import examples
from tests.inject import EXCEPTIONS

pytestmark = pytest.mark.skipif(
    not radix.ENABLED, reason="KVF_NATIVE=0 or not built: the reference alone"
)

PAGE = 1  # tokens a page: every token is a page, so runs share pages often
CAPACITY = 14  # pages per pool: small, so some inserts find no room
FILLS = ("none", "ok", "fail", "quarantine")


class Faults:
    """Raises the planned exception at the `at`-th call out of the insert (1-based), once."""

    def __init__(self) -> None:
        self.at, self.exc, self.calls = 0, ValueError, 0

    def arm(self, at: int, exc: type[BaseException]) -> None:
        self.at, self.exc, self.calls = at, exc, 0

    def step(self, name: str) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise self.exc(f"injected at {name}")


class Allocator:
    """A real allocator, its every call a failure point."""

    def __init__(self, faults: Faults, refused: list) -> None:
        self.real = PageAllocator(CAPACITY, native=False)
        self.faults, self.refused = faults, refused

    @property
    def free_count(self) -> int:
        self.faults.step("free_count")
        return self.real.free_count

    def alloc(self, n: int) -> list[int]:
        self.faults.step("alloc")
        return self.real.alloc(n)

    def free(self, pages: list[int]) -> None:
        try:
            self.faults.step("free")
        except BaseException:
            self.refused.append((self, list(pages)))  # not taken back: these stay used
            raise
        self.real.free(pages)


class Keyer:
    def __init__(self, keyer: PageKeyer, faults: Faults) -> None:
        self.root, self.keyer, self.faults = keyer.root, keyer, faults

    def chain(self, raw: bytes, prev: bytes | None = None) -> list[bytes]:
        self.faults.step("chain")
        return self.keyer.chain(raw, prev)


class Log(ChangeLog):
    """The events' change log (left() calls touched())."""

    def __init__(self, faults: Faults) -> None:
        super().__init__(lambda: 10_000)
        self.overflowed, self.faults = False, faults

    def touched(self, node, offsets) -> None:
        self.faults.step("touched")
        super().touched(node, offsets)


class Side:
    """One twin: a tree, its allocators and the failure points around them."""

    def __init__(self, native: bool, events: bool, dirty: bool) -> None:
        self.faults = Faults()
        self.tree = RadixTree(PAGE * 4, lambda *a: None, lambda *a: None, native=native)
        assert self.tree.native is native
        self.refused: list[tuple[Allocator, list[int]]] = []
        self.allocators = {p: Allocator(self.faults, self.refused) for p in PoolName}
        self.tree.changes = Log(self.faults) if events else None
        self.tree.dirty = set() if dirty else None
        self.keyers = {ns: Keyer(PageKeyer(ns, b"layout", PAGE), self.faults) for ns in "ab"}
        self.held: list[tuple] = []

    def cut(self, ns: str, tokens: list[int]) -> tuple[list, int]:
        """The walk's path, cut where it matched, as the cache's plan makes it."""
        path, m = self.tree.walk(self.keyers[ns].root, encode_tokens(tokens))
        if path and m < path[-1].end:
            self.tree.split_at(path, m)
            path.pop()
        return path, m

    def insert(self, ns, tokens, path, m, todo, fill_kind, hook):
        tree, keyer, raw = self.tree, self.keyers[ns], encode_tokens(tokens)
        got: dict = {}

        def quarantine() -> None:
            self.held.extend(sorted(got.items()))
            got.clear()

        def fill(reserved, quarantine_pages):
            assert reserved is got and quarantine_pages is quarantine
            self.faults.step("fill")
            if fill_kind == "quarantine":
                quarantine_pages()
            return None if fill_kind == "ok" else fill_kind

        hooked = (lambda pool, tier: self.faults.step("hook")) if hook else None
        done = tree.insert_free(
            path,
            raw[m * tree.page_bytes :],
            keyer,
            todo,
            Tier.DEVICE,
            self.allocators,
            hooked,
            None if fill_kind == "none" else fill,
            quarantine,
            got,
        )
        if done is None:
            return None, got
        nodes, failed = done
        return ([node_state(n) for n in nodes], failed), got

    def state(self) -> tuple:
        log = self.tree.changes
        return (
            tree_state(self.tree),
            {p: sorted(a.real.used_indices()) for p, a in self.allocators.items()},
            None if log is None else [(node.keys[0], pos) for node, pos in log.changes],
            None if self.tree.dirty is None else sorted(n.keys[0] for n in self.tree.dirty),
            self.held,
        )

    def whole(self) -> tuple:
        """What a failed insert must leave as it was: the tree (an empty namespace root
        it made may stay) and the pages taken, counting neither those its fill held nor
        those a failing free did not take back."""
        state = tree_state(self.tree)
        roots = [r for r in state[1] if r[1][9]]  # roots with children
        return (state[0], roots, *state[2:]), self.used()

    def used(self) -> dict:
        """Each pool's pages in use but for those held or refused: the tree's own."""
        used = {p: set(a.real.used_indices()) for p, a in self.allocators.items()}
        for (pool, _), pages in self.held:
            used[pool] -= set(pages)
        for alloc, pages in self.refused:
            used[next(p for p, a in self.allocators.items() if a is alloc)] -= set(pages)
        return used


def outcome(fn):
    try:
        return fn()
    except BaseException as e:  # noqa: B036 -- injected types include MemoryError
        if type(e) is AssertionError and "injected" not in str(e):
            # A placement's: its message shows a node, formatted when raised where pytest
            # rewrote the assert, when read in C.
            return AssertionError
        return type(e), str(e)


class TwinInserts(RuleBasedStateMachine):
    @initialize(events=st.booleans(), dirty=st.booleans(), seed=st.integers(0, 2**16))
    def setup(self, events, dirty, seed):
        self.sides = [Side(True, events, dirty), Side(False, events, dirty)]
        rng = random.Random(seed)
        self.seqs = [[rng.randrange(3) for _ in range(8)] for _ in range(4)]

    @rule(
        ns=st.sampled_from("ab"),
        i=st.integers(0, 3),
        length=st.integers(1, 8),
        full=st.one_of(st.none(), st.lists(st.integers(0, 7), unique=True)),
        swa=st.lists(st.integers(0, 7), unique=True),
        fill=st.sampled_from(FILLS),
        hook=st.booleans(),
        at=st.integers(0, 16),
        exc=st.sampled_from(EXCEPTIONS),
        disorder=st.sampled_from(["", "repeat", "fall"]),
    )
    def insert(self, ns, i, length, full, swa, fill, hook, at, exc, disorder):
        tokens = self.seqs[i][:length]
        # None: every new page (a put); a list: any positions (pages held already fail
        # the placement, which must undo itself)
        todo = {
            PoolName.FULL: sorted(full) if full is not None else None,
            PoolName.SWA: sorted(swa),
        }
        cuts = [side.cut(ns, tokens) for side in self.sides]
        before = [side.whole() for side in self.sides]
        outs = []
        for side, (path, m) in zip(self.sides, cuts):
            t = dict(todo)
            if t[PoolName.FULL] is None:
                t[PoolName.FULL] = list(range(m, len(tokens)))
            t = {p: [x for x in pos if x < len(tokens)] for p, pos in t.items()}
            swa_at = t[PoolName.SWA]
            if disorder == "repeat" and swa_at:  # two pages for one slot: refused whole
                swa_at.append(swa_at[-1])
            elif disorder == "fall":
                swa_at.reverse()
            side.faults.arm(at, exc)
            outs.append(outcome(lambda: side.insert(ns, tokens, path, m, t, fill, hook)))
            side.faults.arm(0, exc)
        assert outs[0] == outs[1]
        assert self.sides[0].state() == self.sides[1].state()
        result = outs[0]
        committed = (
            isinstance(result, tuple) and isinstance(result[0], tuple) and (result[0][1] is None)
        )
        for side, was in zip(self.sides, before):
            if not committed:
                assert side.whole() == was  # nothing half done
            assert side.tree.owned[Tier.DEVICE] == [len(u) for u in side.used().values()]


TestTwinInserts = TwinInserts.TestCase
TestTwinInserts.settings = settings(
    max_examples=examples(150), stateful_step_count=12, deadline=None
)


def test_bad_arguments_are_refused_and_change_nothing():
    tree = RadixTree(4, lambda *a: None, lambda *a: None, native=True)
    keyer = PageKeyer("a", b"layout", 1)
    allocs = {p: PageAllocator(4, native=False) for p in PoolName}
    good = (
        [],
        b"\x01\0\0\0",
        keyer,
        {PoolName.FULL: [0]},
        Tier.DEVICE,
        allocs,
        None,
        None,
        None,
        {},
    )
    for at, bad in ((0, ()), (1, "x"), (3, []), (5, []), (9, [])):
        args = list(good)
        args[at] = bad
        with pytest.raises(TypeError):
            tree.insert_free(*args)
    with pytest.raises(TypeError):
        tree.insert_free(*good[:9])
    assert tree.node_count == 0 and not tree.roots
    assert all(a.free_count == 4 for a in allocs.values())
    nodes, failed = tree.insert_free(*good)
    assert failed is None and [n.keys for n in nodes] == [keyer.chain(b"\x01\0\0\0")]
    assert allocs[PoolName.FULL].free_count == 3 and tree.owned[Tier.DEVICE][PoolName.FULL] == 1


@pytest.mark.parametrize("native", [True, False])
def test_a_placement_onto_a_held_page_writes_none_of_its_pages(native):
    """set_pages checks every slot before it writes one: a placement that breaks off on a
    held page must not leave its earlier pages in the node (its caller frees them)."""
    tree = RadixTree(4, lambda *a: None, lambda *a: None, native=native)
    root = tree.root(b"r")
    node = tree.attach(root, [b"k0", b"k1", b"k2"], b"\0" * 12, None)
    tree.set_pages(node, Tier.DEVICE, PoolName.FULL, [1], [7], None)
    before = tree_state(tree)
    with pytest.raises(AssertionError):
        tree.set_pages(node, Tier.DEVICE, PoolName.FULL, [0, 1, 2], [4, 5, 6], None)
    with pytest.raises(IndexError):
        tree.set_pages(node, Tier.DEVICE, PoolName.SWA, [0, 9], [4, 5], None)
    assert tree_state(tree) == before
    assert node.slots[Tier.DEVICE][PoolName.SWA] is None


class ShortKeyer:
    """A keyer that keys a run shorter than a page (ours never does): edge input."""

    root = b"r"

    def chain(self, raw: bytes, prev: bytes | None = None) -> list[bytes]:
        return [b"k"]


@pytest.mark.parametrize("native", [True, False])
def test_a_failed_placement_under_a_short_run_undoes_it_whole(native):
    tree = RadixTree(4, lambda *a: None, lambda *a: None, native=native)
    alloc = PageAllocator(4, native=False)
    with pytest.raises(AssertionError):  # position 5 lies past the one-key run
        tree.insert_free(
            [], b"ab", ShortKeyer(), {PoolName.FULL: [5]}, Tier.DEVICE,
            {PoolName.FULL: alloc}, None, None, None, {},
        )  # fmt: skip
    assert (tree.node_count, tree.page_count, tree.roots, tree.by_first_key) == (0, 0, {}, {})
    assert alloc.free_count == 4


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("positions", [[0, 0], [1, 0], [0, 2, 1]])
def test_positions_that_do_not_rise_are_refused_whole(native, positions):
    """A repeated position would put two pages in one slot, one of them then owned by no
    one; a falling one defeats the search for its node."""
    tree = RadixTree(4, lambda *a: None, lambda *a: None, native=native)
    allocs = {p: PageAllocator(4, native=False) for p in PoolName}
    todo = {PoolName.FULL: [0, 1, 2], PoolName.SWA: positions}
    with pytest.raises(ValueError, match="positions must rise"):
        tree.insert_free(
            [], b"\x01\0\0\0" * 3, PageKeyer("a", b"layout", 1), todo, Tier.DEVICE,
            allocs, None, None, None, {},
        )  # fmt: skip
    assert (tree.node_count, tree.page_count, tree.by_first_key) == (0, 0, {})
    assert all(a.free_count == 4 for a in allocs.values())
