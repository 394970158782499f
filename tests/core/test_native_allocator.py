"""The page allocator's two implementations, C (`_alloc`) and the pure-Python reference
(allocator.py), driven through the same random calls with valid and invalid input: the
results, the errors (type and message) and the state after each call must agree, and a
refused call must change nothing. tests/core runs on both through KVF_NATIVE."""

import gc
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kvfabric.core.cache import allocator
from kvfabric.core.cache.allocator import AllocatorError, OutOfPages, PageAllocator

from tests.examples import examples

needs_native = pytest.mark.skipif(
    not allocator.ENABLED, reason="KVF_NATIVE=0 or not built: the reference alone"
)
both_kinds = pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])


class Sub(int):
    """An int subclass: accepted as a count, refused as a page (only exact ints are pages)."""


def outcome(call):
    """What a call gave: ("ok", repr of the result) or ("raised", type, message)."""
    try:
        return ("ok", repr(call()))
    except Exception as e:  # every type: the twins must agree on all of them
        return ("raised", type(e), str(e))


def state(a) -> tuple:
    return (a.capacity, a.free_count, a.used_count, sorted(a.used_indices()))


def free_order(a) -> list[int]:
    """Every free page in the order alloc hands them out; free() puts them back as they were."""
    out = a.alloc(a.free_count)
    a.free(out)
    return out


def twins(capacity: int) -> tuple:
    return PageAllocator(capacity, native=True), PageAllocator(capacity, native=False)


def both(c, p, call) -> tuple:
    """The call on both twins; equal outcomes, and an unchanged state where it was refused."""
    before = state(c), state(p)
    got = outcome(lambda: call(c)), outcome(lambda: call(p))
    assert got[0] == got[1], got
    assert state(c) == state(p)
    if got[0][0] == "raised":
        assert (state(c), state(p)) == before
    return got[0]


# A page as callers might wrongly pass one: out of range, a bool, a float, a subclass, ...
odd_pages = st.one_of(
    st.integers(-3, -1),
    st.integers(2**31 - 2, 2**31 + 1),
    st.integers(2**63 - 1, 2**64),
    st.just(-(2**70)),
    st.booleans(),
    st.sampled_from([1.0, 0.5, "1", b"\x01", None, (1,), [1], Sub(1), Sub(0)]),
)
counts = st.one_of(
    st.integers(-3, 25),
    st.sampled_from([2**70, -(2**70), True, False, 1.0, "2", None, Sub(2), Sub(-1)]),
)


class AllocatorTwins(RuleBasedStateMachine):
    @initialize(capacity=st.integers(0, 20))
    def make(self, capacity):
        self.c, self.p = twins(capacity)

    def pick(self, data, pool: list[int]) -> list:
        """A list of pages drawn mostly from `pool`, with repeats and odd pages mixed in."""
        page = st.one_of(
            st.sampled_from(pool) if pool else st.nothing(),
            st.integers(0, max(self.p.capacity - 1, 0)),
            st.integers(self.p.capacity, self.p.capacity + 2),
            odd_pages,
        )
        return data.draw(st.lists(page, max_size=8))

    def container(self, data, pages: list):
        kind = data.draw(st.sampled_from(["list", "tuple", "set", "range", "str", "int", "gen"]))
        make = {
            "list": lambda: list(pages),
            "tuple": lambda: tuple(pages),
            "set": lambda: set(p for p in pages if isinstance(p, int)),
            "range": lambda: range(len(pages)),
            "str": lambda: "01",
            "int": lambda: 1,
            "gen": lambda: (p for p in pages),
        }[kind]
        return make  # a fresh container per twin: a generator is used up by the first

    @rule(n=counts)
    def alloc(self, n):
        both(self.c, self.p, lambda a: a.alloc(n))

    @rule(data=st.data())
    def free(self, data):
        pages = self.pick(data, sorted(self.p.used_indices()))
        make = self.container(data, pages)
        both(self.c, self.p, lambda a: a.free(make()))

    @rule(data=st.data())
    def take(self, data):
        free = sorted(set(range(self.p.capacity)) - self.p.used_indices())
        make = self.container(data, self.pick(data, free))
        both(self.c, self.p, lambda a: a.take(make()))

    @rule()
    def used_indices(self):
        got = self.c.used_indices()
        assert type(got) is set and got == self.p.used_indices()
        got.add(-5)  # a copy: the allocator's state is not the caller's set
        assert -5 not in self.c.used_indices()

    @invariant()
    def same_order(self):
        assert free_order(self.c) == free_order(self.p)
        assert state(self.c) == state(self.p)


TestAllocatorTwins = needs_native(AllocatorTwins.TestCase)
TestAllocatorTwins.settings = settings(
    max_examples=examples(300), stateful_step_count=40, deadline=None
)


@needs_native
@given(capacity=st.integers(1, 12), data=st.data())
@settings(deadline=None)
def test_a_bad_page_anywhere_changes_nothing(capacity, data):
    """The failure path at every step: a run of good pages with one bad page at each place."""
    for method in ("free", "take"):
        c, p = twins(capacity)
        used = c.alloc(capacity // 2)
        p.alloc(capacity // 2)
        good = used if method == "free" else [i for i in range(capacity) if i not in used]
        bad = data.draw(st.one_of(odd_pages, st.sampled_from(good or [0])))
        for at in range(len(good) + 1):
            pages = good[:at] + [bad] + good[at:]
            assert both(c, p, lambda a: getattr(a, method)(pages))[0] == "raised"
            assert free_order(c) == free_order(p)


@both_kinds
def test_fresh_order_errors_and_messages(native):
    a = PageAllocator(4, native=native)
    assert a.alloc(3) == [0, 1, 2] and a.free_count == 1 and a.used_count == 3
    a.free([2, 0])
    assert a.alloc(2) == [2, 0]  # freed pages come back in the order they were freed
    with pytest.raises(OutOfPages, match=r"^want 2 pages, 1 free of 4$"):
        a.alloc(2)
    with pytest.raises(AllocatorError, match=r"^page 3 is already free$"):
        a.free([3])
    with pytest.raises(AllocatorError, match=r"^page 0 is already in use$"):
        a.take([0])
    with pytest.raises(AllocatorError, match=r"^page True is not in this allocator \(capacity"):
        a.free([True])
    with pytest.raises(TypeError, match="n must be an int, got True"):
        a.alloc(True)
    with pytest.raises(TypeError, match="indices must be a list or tuple of ints, got set"):
        a.free({0})
    with pytest.raises(ValueError, match=r"capacity must be an int in \[0, 2147483647\]"):
        PageAllocator(2**31, native=native)
    with pytest.raises(ValueError, match="got True"):
        PageAllocator(True, native=native)


@both_kinds
def test_a_page_whose_repr_empties_the_list(native):
    """Making the message runs the bad page's repr; the refusal is complete before it."""
    a = PageAllocator(4, native=native)
    pages = a.alloc(3)

    class Emptier:
        def __repr__(self) -> str:
            pages.clear()
            return "emptier"

    pages.append(Emptier())
    with pytest.raises(AllocatorError, match="page emptier is not in this allocator"):
        a.free(pages)
    assert a.used_indices() == {0, 1, 2} and a.alloc(1) == [3]


@needs_native
def test_native_is_the_default_and_not_gc_tracked():
    a = PageAllocator(8)
    assert type(a) is allocator.EXT.PageAllocator and isinstance(a, PageAllocator)
    assert not gc.is_tracked(a)
    assert type(PageAllocator(8, native=False)) is PageAllocator
    with pytest.raises(AttributeError):
        a.capacity = 9  # type: ignore[misc]


def test_a_subclass_is_the_reference():
    class Counted(PageAllocator):
        __slots__ = ()

    assert type(Counted(3)) is Counted and Counted(3).alloc(2) == [0, 1]


def test_native_asked_for_without_the_extension():
    with mock.patch.object(allocator, "EXT", None):
        with pytest.raises(RuntimeError, match="native page allocator asked for"):
            PageAllocator(4, native=True)
        assert type(PageAllocator(4)) is PageAllocator


@needs_native
def test_set_errors_checks_its_arguments():
    with pytest.raises(TypeError, match="takes 2 arguments"):
        allocator.EXT.set_errors(AllocatorError)
    with pytest.raises(TypeError, match="Exception subclasses"):
        allocator.EXT.set_errors(AllocatorError, int)
