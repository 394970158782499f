"""KnownPages (the pages an engine saw its node take, by vLLM's block hashes) against a
list that keeps the same history: what it holds, its bound, and which hashes end pages."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.deploy.vllm.connector.known_pages import KnownPages

from tests.examples import examples

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 20), max_size=8)),
        st.tuples(st.just("forget"), st.just([])),
    ),
    max_size=40,
)


@settings(max_examples=examples(300))
@given(ops, st.integers(1, 12), st.lists(st.integers(0, 20), max_size=10))
def test_holds_the_last_pages_learned_up_to_its_bound(history, capacity, asked):
    known = KnownPages(page_size=16, hash_block_size=16, capacity=capacity)
    recent: list[int] = []  # least recently learned first
    for op, hashes in history:
        if op == "forget":
            known.forget()
            recent = []
            continue
        known.add(hashes)
        for h in hashes:
            if h in recent:
                recent.remove(h)
            recent.append(h)
        recent = recent[-capacity:]
        assert len(known) == len(recent) <= capacity
    want = 0
    while want < len(asked) and asked[want] in recent:
        want += 1
    assert known.leading(asked) == want


@given(st.sampled_from([1, 2, 4, 8, 16]), st.integers(0, 12), st.integers(0, 60))
def test_each_page_is_named_by_the_hash_that_ends_it(blocks_a_page, pages, hashed):
    hash_block = 16 // blocks_a_page
    block_hashes = [f"h{i}" for i in range(hashed)]
    got = KnownPages(page_size=16, hash_block_size=hash_block).of(block_hashes, pages)
    want = tuple(
        block_hashes[(p + 1) * blocks_a_page - 1]
        for p in range(pages)
        if (p + 1) * blocks_a_page <= hashed
    )
    assert got == want


@pytest.mark.parametrize("hash_block_size", [None, 0, 3, 32])
def test_hashes_that_do_not_end_on_pages_name_none(hash_block_size):
    known = KnownPages(page_size=16, hash_block_size=hash_block_size)
    assert known.of([f"h{i}" for i in range(8)], 4) == ()


def test_a_bound_below_one_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        KnownPages(page_size=16, hash_block_size=16, capacity=0)
