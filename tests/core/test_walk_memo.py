"""The walk a match keeps for the put that follows (core/cache/walk_memo.py): a put after a
match packs and walks nothing again, and the memo never answers for tokens changed in
place, other tokens, another namespace or a tree whose shape changed in between. A cache
whose memo never answers is the reference: driven through the same steps, both must end
with the same pages, matches and snapshots."""

from array import array
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.core.cache import node_cache
from kvfabric.core.cache.keys import KeyError_, PageKeyer, encode_tokens
from kvfabric.core.cache.layout import KVLayout, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.walk_memo import Walk, WalkMemo

from tests.examples import examples

LAYOUTS = {
    "full": KVLayout(layers=("full",), kv_heads=1, head_dim=1, page_size=2),
    "mixed": KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=1, page_size=2, window=2),
}


def make(layout: KVLayout, device: int = 64) -> NodeCache:
    caps = {p: PoolCapacity(device, 0) for p in layout.pools}
    return NodeCache(layout, caps, store_bytes=False, device="cpu")


def counting_packs():
    return mock.patch.object(node_cache, "encode_tokens", wraps=node_cache.encode_tokens)


def test_a_put_after_its_match_packs_and_walks_once():
    cache = make(LAYOUTS["full"])
    tokens = list(range(40))
    with (
        counting_packs() as packs,
        mock.patch.object(cache.tree, "walk", wraps=cache.tree.walk) as walks,
    ):
        cache.match(tokens, "a")
        assert cache.put(tokens, None, "a") == 20
    assert packs.call_count == 1 and walks.call_count == 1
    assert cache.match(tokens, "a").usable_pages == 20


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.__setitem__(3, 99),  # the same list, changed in place
        lambda t: t.append(7),
        lambda t: t.pop(),
        lambda t: t.__setitem__(slice(None), list(reversed(t))),
    ],
)
def test_tokens_changed_in_place_after_the_match_are_packed_again(change):
    cache, reference = make(LAYOUTS["full"]), make(LAYOUTS["full"])
    tokens = list(range(41))
    cache.match(tokens, "a")
    change(tokens)
    with counting_packs() as packs:
        cache.put(tokens, None, "a")
    assert packs.call_count == 1  # the memo refused: the put packed the tokens it was given
    reference.put(list(tokens), None, "a")
    assert cache.snapshot() == reference.snapshot()
    assert cache.match(tokens, "a").usable_pages == len(tokens) // 2


def test_another_namespace_or_a_reshaped_tree_is_walked_again():
    cache = make(LAYOUTS["full"])
    tokens = list(range(40))
    cache.match(tokens, "a")
    with counting_packs() as packs:
        cache.put(tokens, None, "b")  # another tenant: other keys
    assert packs.call_count == 1
    cache.match(tokens, "a")
    cache.put(tokens[:10] + [500] * 10, None, "a")  # splits nothing yet: a new root child
    cache.put(tokens[:6], None, "a")  # a shape change under the match's path: a split
    with counting_packs() as packs:
        cache.put(tokens, None, "a")
    assert packs.call_count == 1
    cache.check()
    assert cache.match(tokens, "a").usable_pages == 20


def test_the_memo_answers_for_tokens_that_encode_to_its_bytes_only():
    memo = WalkMemo()
    raw = encode_tokens([1, 2])
    memo.remember("a", 0, Walk(PageKeyer("a", b"f" * 16, 1), raw, [], 0))
    for same in ([1, 2], (1, 2), array("q", [1, 2]), bytearray(b"\x01\x02"), range(1, 3)):
        assert memo.recall(same, "a", 0) is not None, same
    for other in ([1, 3], [1], [1, 2, 0], [2, 1], (), array("i", [1, 2, 3]), [1, 2**31 - 1]):
        assert memo.recall(other, "a", 0) is None, other
    assert memo.recall([1, 2], "a", 1) is None and memo.recall([1, 2], "b", 0) is None
    with pytest.raises(KeyError_, match="token 1"):  # what a walk of them raises
        memo.recall([1, 2**40], "a", 0)


class Forgetful(WalkMemo):
    """Never answers: every step packs and walks."""

    __slots__ = ()

    def recall(self, tokens, namespace, version):
        return None


STEP = st.one_of(
    st.tuples(st.just("match"), st.integers(0, 5)),
    st.tuples(st.just("put"), st.integers(0, 5)),
    st.tuples(st.just("get"), st.integers(0, 5)),
    st.tuples(st.just("evict"), st.integers(1, 8)),
    st.tuples(st.just("change"), st.integers(0, 5), st.integers(0, 30), st.integers(0, 3)),
    st.tuples(st.just("grow"), st.integers(0, 5), st.integers(1, 6)),
)


@settings(max_examples=examples(150), deadline=None)
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    seqs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=24), min_size=6, max_size=6),
    steps=st.lists(STEP, max_size=40),
    device=st.integers(6, 40),
)
def test_the_memo_changes_nothing_a_cache_without_it_would_do(layout, seqs, steps, device):
    """Lists shared with the caller and changed in place between steps, as an engine's
    growing token lists are; small pools, so puts evict (a shape change) as they go."""
    cache, reference = make(LAYOUTS[layout], device), make(LAYOUTS[layout], device)
    reference._walks = Forgetful()
    ns = ("a", "b")
    for step in steps:
        kind, i = step[0], step[1]
        if kind == "evict":
            for c in (cache, reference):
                c.evict(c.primary_pool, Tier.DEVICE, step[1])
            assert cache.snapshot() == reference.snapshot(), step
            continue
        tokens = seqs[i]
        if kind == "change":
            tokens[step[2] % len(tokens)] = step[3]
            continue
        if kind == "grow":
            tokens.extend([i % 4] * step[2])
            continue
        got = []
        for c in (cache, reference):
            if kind == "match":
                m = c.match(tokens, ns[i % 2])
                got.append((m.present_pages, m.usable_pages, m.usable_device_pages))
            elif kind == "put":
                got.append(c.put(tokens, None, ns[i % 2]))
            else:
                got.append(c.get(tokens, ns[i % 2]).tokens)
        assert got[0] == got[1], step
        assert cache.snapshot() == reference.snapshot(), step
    cache.check()
