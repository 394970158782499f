"""Merging page pairs into descriptors (transport/runs.py) and the read plan built on it:
whatever the page lists, the merged descriptors move exactly the bytes the pairs name,
from the same remote bytes to the same local bytes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.transport.base import (
    MemKind,
    PoolLayout,
    coalesce_order,
    has_duplicates,
    plan_pool_read,
)
from kvfabric.transport.runs import PageRuns, merge_runs, order_pairs

from tests.examples import examples

PAGE_BYTES = 3  # odd, so that a run off by a page or a byte shows


@st.composite
def page_pairs(draw) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(remote, local, remote capacity, local capacity): local pages distinct, remote ones
    may repeat; built from contiguous stretches (as a cache holds pages), then shuffled."""
    cap_r, cap_l = draw(st.integers(1, 200)), draw(st.integers(1, 200))
    chunks = draw(
        st.lists(
            st.tuples(st.integers(0, cap_r - 1), st.integers(0, cap_l - 1), st.integers(1, 12)),
            max_size=12,
        )
    )
    pairs: dict[int, int] = {}  # local -> remote: the first write to a local page wins
    for r0, l0, n in chunks:
        for k in range(min(n, cap_r - r0, cap_l - l0)):
            pairs.setdefault(l0 + k, r0 + k)
    items = draw(st.permutations(sorted(pairs.items())))
    local = np.array([lp for lp, _ in items], dtype=np.int64)
    remote = np.array([rp for _, rp in items], dtype=np.int64)
    return remote, local, cap_r, cap_l


def coverage(starts: np.ndarray, lengths: np.ndarray, size: int) -> np.ndarray:
    """How many times each byte of a `size`-byte pool is named by the ranges."""
    count = np.zeros(size + 1, dtype=np.int64)
    np.add.at(count, starts, 1)
    np.add.at(count, starts + lengths, -1)
    return np.cumsum(count)[:size]


def expand(runs: PageRuns) -> list[tuple[int, int]]:
    return [
        (r + k, l_ + k)
        for r, l_, n in zip(runs.remote.tolist(), runs.local.tolist(), runs.pages.tolist())
        for k in range(n)
    ]


@settings(max_examples=examples(300), deadline=None)
@given(page_pairs())
def test_merged_descriptors_cover_exactly_the_pages_bytes_on_both_sides(case) -> None:
    remote, local, cap_r, cap_l = case
    r, l_ = order_pairs(remote, local)
    runs = merge_runs(r, l_)
    # The ordering is a permutation of the pairs, and the runs expand back to it.
    assert sorted(zip(r.tolist(), l_.tolist())) == sorted(zip(remote.tolist(), local.tolist()))
    assert expand(runs) == list(zip(r.tolist(), l_.tolist()))
    assert (runs.pages >= 1).all() and runs.pages.sum() == len(remote)
    # Bytes: each local byte of a named page written once, nothing else; each remote
    # byte read as often as its page is named.
    r_off, l_off, nbytes = runs.byte_ranges(PAGE_BYTES)
    pages_l = np.repeat(np.bincount(local, minlength=cap_l), PAGE_BYTES)
    pages_r = np.repeat(np.bincount(remote, minlength=cap_r), PAGE_BYTES)
    assert (coverage(l_off, nbytes, cap_l * PAGE_BYTES) == pages_l).all()
    assert (coverage(r_off, nbytes, cap_r * PAGE_BYTES) == pages_r).all()
    # And every local byte is read from the remote byte its pair names.
    source = np.full(cap_l * PAGE_BYTES, -1, dtype=np.int64)
    for ro, lo, n in zip(r_off.tolist(), l_off.tolist(), nbytes.tolist()):
        source[lo : lo + n] = np.arange(ro, ro + n)
    wanted = np.full(cap_l * PAGE_BYTES, -1, dtype=np.int64)
    for rp, lp in zip(remote.tolist(), local.tolist()):
        wanted[lp * PAGE_BYTES : (lp + 1) * PAGE_BYTES] = np.arange(
            rp * PAGE_BYTES, (rp + 1) * PAGE_BYTES
        )
    assert (source == wanted).all()
    # Runs are maximal: no run continues the previous one on both sides.
    ends_r, ends_l = runs.remote + runs.pages, runs.local + runs.pages
    assert not ((runs.remote[1:] == ends_r[:-1]) & (runs.local[1:] == ends_l[:-1])).any()
    assert coalesce_order(remote, local)[2] == len(runs)


@settings(max_examples=examples(200), deadline=None)
@given(page_pairs())
def test_runs_are_the_fewest_possible_when_remote_pages_are_distinct(case) -> None:
    remote, local, _, _ = case
    _, first = np.unique(remote, return_index=True)
    remote, local = remote[np.sort(first)], local[np.sort(first)]
    pairs = set(zip(remote.tolist(), local.tolist()))
    # A pair must start a descriptor unless the pair one page before it on both sides is
    # read too; ordering by remote page merges every other pair.
    fewest = sum((r - 1, l_ - 1) not in pairs for r, l_ in pairs)
    assert len(merge_runs(*order_pairs(remote, local))) == fewest


@settings(max_examples=examples(200), deadline=None)
@given(page_pairs())
def test_read_plan_keeps_the_pairs_and_counts_their_descriptors(case) -> None:
    remote, local, cap_r, cap_l = case
    plan = plan_pool_read(
        "p",
        (remote.tolist(), local),
        PoolLayout(1 << 20, PAGE_BYTES, cap_l, MemKind.DRAM, 0),
        PoolLayout(1 << 30, PAGE_BYTES, cap_r, MemKind.DRAM, 0),
    )
    got = sorted(zip(plan.remote.tolist(), plan.local.tolist()))
    assert got == sorted(zip(remote.tolist(), local.tolist()))
    runs = merge_runs(plan.remote.astype(np.int64), plan.local.astype(np.int64))
    assert expand(runs) == list(zip(plan.remote.tolist(), plan.local.tolist()))
    assert plan.descriptors == len(runs)


@given(st.lists(st.integers(0, 99), max_size=50), st.sampled_from([100, 1 << 22]))
def test_duplicate_check_agrees_with_a_set(idx: list[int], capacity: int) -> None:
    # Both ways of checking: a mask (small pools) and a sort (pools far larger than the read).
    assert has_duplicates(np.array(idx, dtype=np.int64), capacity) == (len(set(idx)) != len(idx))


def test_plan_rejects_a_local_page_written_twice() -> None:
    layout = PoolLayout(0, 8, 10, MemKind.DRAM, 0)
    with pytest.raises(ValueError, match="appears twice"):
        plan_pool_read("p", ([1, 2], [3, 3]), layout, layout)
    big = PoolLayout(0, 8, 1 << 22, MemKind.DRAM, 0)
    with pytest.raises(ValueError, match="appears twice"):
        plan_pool_read("p", ([1, 2], [4_000_000, 4_000_000]), big, big)


def test_pools_past_the_radix_sort_order_the_same() -> None:
    remote = np.array([70_000, 5, 70_001, 6], dtype=np.int64)
    local = np.array([2, 0, 3, 1], dtype=np.int64)
    r, l_ = order_pairs(remote, local)
    assert r.tolist() == [5, 6, 70_000, 70_001] and l_.tolist() == [0, 1, 2, 3]
    assert merge_runs(r, l_).pages.tolist() == [2, 2]
