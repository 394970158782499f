"""The prefix index's lookups against a brute force that reads the usable-match rule from
the attention policies, over random holders, batches, replays, gaps and snapshots."""

from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.core.cache.keys import PageKeyer
from kvfabric.core.cache.layout import KVLayout, LayerKind, PoolName, Tier
from kvfabric.core.cache.policies import policies_for
from kvfabric.core.index.answers import NodeMatch
from kvfabric.core.index.events import EventBatch, PageState, Snapshot
from kvfabric.core.index.events import PageMask as M
from kvfabric.core.index.match_rule import MatchRule
from kvfabric.core.index.prefix_index import ApplyResult as R
from kvfabric.core.index.prefix_index import PrefixIndex
from kvfabric.core.index.presence import Presence

from tests.examples import examples

KEYER = PageKeyer("tenant", b"f" * 16, 2)
FULL_ALL = int(M.FULL | M.SWA)  # every pool on both tiers: 15


def layout_of(window, has_full, page_size=2):
    """A layout whose policies need what (window, has_full) says."""
    layers = (LayerKind.FULL,) * has_full + (LayerKind.SWA,) * bool(window)
    return KVLayout(layers, kv_heads=1, head_dim=1, page_size=page_size, window=window * page_size)


# What a pool's pages carry in a node's published mask: on some tier, in memory (device or
# host), on the device.
HELD = {
    PoolName.FULL: (M.FULL, M.FULL_DEVICE | M.FULL_HOST, M.FULL_DEVICE),
    PoolName.SWA: (M.SWA, M.SWA_DEVICE | M.SWA_HOST, M.SWA_DEVICE),
}


def brute_lookup(model, keys, layout):
    """The usable-match rule read literally from the layout's policies (every pool holds
    the pages its policy `needed`), O(n^2) per node."""
    policies = policies_for(layout).values()
    out = []
    for node, pages in model.items():
        masks = [pages.get(k, 0) for k in keys]
        for n in range(len(keys), 0, -1):
            need = [(HELD[p.pool], p.needed(n)) for p in policies]
            if all(masks[i] & bits[0] for bits, span in need for i in span):
                on = [all(masks[i] & bits[t] for bits, span in need for i in span) for t in (2, 1)]
                tier = Tier.DEVICE if on[0] else Tier.HOST if on[1] else Tier.DISK
                out.append(NodeMatch(node, n, tier))
                break
    return sorted(out, key=lambda m: (-m.pages, m.tier, m.node))


def test_the_rule_is_the_policies():
    for window, has_full in ((0, True), (1, True), (3, True), (2, False)):
        assert MatchRule.of(layout_of(window, has_full)) == MatchRule(window, has_full)
    # a window of 5 tokens at page size 2 needs 3 pages before a page boundary
    swa = KVLayout((LayerKind.FULL, LayerKind.SWA), kv_heads=1, head_dim=1, page_size=2, window=5)
    assert MatchRule.of(swa) == MatchRule(3, True)


# What a node's tree really holds per page (both tiers, tombstones, host-only...), and 0.
PATTERNS = [
    FULL_ALL,
    int(M.FULL_DEVICE | M.SWA_DEVICE),
    int(M.FULL_HOST | M.SWA_HOST),
    int(M.FULL_DEVICE),
    int(M.FULL_HOST),
    int(M.FULL_DEVICE | M.SWA_HOST),
    int(M.FULL_HOST | M.SWA_DEVICE),
    int(M.SWA_DEVICE),
]
MASKS = st.one_of(st.sampled_from(PATTERNS), st.integers(0, int(M.FULL | M.SWA)))  # disk too


@st.composite
def scenarios(draw):
    """A few sequences sharing prefixes; each node publishes prefixes of some of them (mostly
    realistic masks), then random changes and removals, in randomly cut batches."""
    seqs = [draw(st.lists(st.integers(0, 3), min_size=2, max_size=24))]
    for _ in range(draw(st.integers(0, 3))):
        base = draw(st.sampled_from(seqs))
        cut = draw(st.integers(0, len(base)))
        seqs.append(base[:cut] + draw(st.lists(st.integers(0, 3), max_size=12)))
    seq_keys = [KEYER.keys(s) for s in seqs]
    pages = {}
    for keys in seq_keys:
        for d, (k, parent) in enumerate(zip(keys, [KEYER.root] + keys[:-1])):
            pages[k] = (parent, d)
    page_keys = sorted(pages)
    batches = []  # (node, cleared, [(key, mask)])
    for node in draw(st.lists(st.sampled_from("abcde"), min_size=1, max_size=4, unique=True)):
        evs = []
        for keys in draw(st.lists(st.sampled_from(seq_keys), max_size=2)):
            held = keys[: draw(st.integers(0, len(keys)))]
            evs += zip(held, draw(st.lists(MASKS, min_size=len(held), max_size=len(held))))
        evs += draw(
            st.lists(
                st.tuples(st.sampled_from(page_keys), st.sampled_from([0, *PATTERNS])), max_size=4
            )
        )
        cuts = sorted(draw(st.sets(st.integers(0, len(evs)), max_size=3)) | {len(evs)})
        for lo, hi in zip([0] + cuts, cuts):
            batches.append((node, draw(st.integers(0, 5)) == 0, evs[lo:hi], False))
        for keys in draw(st.lists(st.sampled_from(seq_keys), max_size=2)):  # chains, as after a put
            hi = draw(st.integers(0, len(keys)))
            lo = draw(st.integers(0, hi))
            mask = draw(st.sampled_from([0, *PATTERNS]))
            batches.append(
                (node, draw(st.integers(0, 5)) == 0, [(k, mask) for k in keys[lo:hi]], True)
            )
    draw(st.randoms(use_true_random=False)).shuffle(
        batches
    )  # nodes interleave; per node, seq order
    window = draw(st.integers(0, 4))
    has_full = draw(st.booleans()) or window == 0
    return seq_keys, pages, batches, window, has_full


def build(pages, batches):
    """EventBatches with per-node seq numbers, and the model of what each node holds."""
    seq, model, out = {}, {}, []
    for node, cleared, evs, _ in batches:
        held = model.setdefault(node, {})
        if cleared:
            held.clear()
        for k, m in evs:
            held[k] = m
            if not m:
                del held[k]
        states = tuple(PageState(k, *pages[k], m) for k, m in evs)
        out.append(EventBatch(node, 3, seq.setdefault(node, 0), states, cleared))
        seq[node] += 1
    return out, model, seq


def chain_args(b, pages):
    """apply_chain's arguments for an EventBatch of one chain of pages, all with one mask."""
    keys = [p.key for p in b.pages]
    parent, depth = pages[keys[0]] if keys else (KEYER.root, 0)
    return b.node, b.epoch, b.seq, keys, depth, parent, b.pages[0].mask if keys else 1, b.cleared


def answers(ix, seq_keys):
    return [ix.lookup(keys[:n]) for keys in seq_keys for n in range(1, len(keys) + 1)]


@given(scenarios(), st.randoms(use_true_random=False))
def test_lookup_equals_brute_force(scenario, rnd):
    seq_keys, pages, raw, window, has_full = scenario
    events, model, next_seq = build(pages, raw)
    ix = PrefixIndex(MatchRule.of(layout_of(window, has_full)))
    assert all(ix.apply(b) is R.APPLIED for b in events)
    expected = [
        brute_lookup(model, keys[:n], layout_of(window, has_full))
        for keys in seq_keys
        for n in range(1, len(keys) + 1)
    ]
    assert answers(ix, seq_keys) == expected
    assert {n: {k: p.mask for k, p in ix.node_pages(n).items()} for n in ix.nodes()} == model
    assert len(ix) == len(set().union(*model.values()))
    # duplicates, in any order, change nothing
    rnd.shuffle(events)
    assert all(ix.apply(b) is R.DUPLICATE for b in events)
    assert answers(ix, seq_keys) == expected
    # a gap changes nothing either; the snapshot the caller then fetches restores the truth
    node = rnd.choice(sorted(model))
    wipe = tuple(PageState(k, *pages[k], 0) for k in pages)
    assert ix.apply(EventBatch(node, 3, next_seq[node] + 1, wipe)) is R.NEED_SNAPSHOT
    assert answers(ix, seq_keys) == expected
    snap = tuple(PageState(k, *pages[k], m) for k, m in model[node].items())
    assert ix.load_snapshot(Snapshot(node, 3, next_seq[node] + 1, snap)) is R.APPLIED
    assert answers(ix, seq_keys) == expected
    # the chains applied with apply_chain instead of their EventBatches: the same index
    events, _, _ = build(pages, raw)
    cx = PrefixIndex(MatchRule(window, has_full))
    for b, (*_, is_chain) in zip(events, raw):
        assert (cx.apply_chain(*chain_args(b, pages)) if is_chain else cx.apply(b)) is R.APPLIED
    assert answers(cx, seq_keys) == expected
    assert {n: cx.node_pages(n) for n in cx.nodes()} == {n: ix.node_pages(n) for n in ix.nodes()}
    assert all(cx.page_meta(k) == ix.page_meta(k) for k in pages) and len(cx) == len(ix)
    assert all(
        cx.apply_chain(*chain_args(b, pages)) is R.DUPLICATE for b, r in zip(events, raw) if r[3]
    )


ROOT = b"\xff" * 16


@settings(max_examples=examples(80), deadline=None)
@given(
    window=st.integers(0, 3),
    has_full=st.booleans(),
    chains=st.lists(
        st.tuples(st.integers(0, 7), st.integers(0, 11), st.integers(1, 6), st.integers(0, 63)),
        min_size=1,
        max_size=30,
    ),
    looked_up=st.lists(st.tuples(st.integers(0, 11), st.integers(1, 12)), min_size=1, max_size=8),
)
def test_reference_word_path_equals_repacked(window, has_full, chains, looked_up):
    """The reference's lookups where every open slot is below 8 (the packed codes as
    they are) answer as where slots reach past a word (each lookup's candidates repacked):
    the same holders at slot s and at slot s + 16, pairs and bitsets alike."""
    if not (window or has_full):
        has_full = True
    keys = [bytes([i]) * 16 for i in range(1, 13)]
    word, wide = Presence(window, has_full), Presence(window, has_full)
    for s in range(8):
        word.open(s)
        wide.open(s + 16)
    for slot, first, n, mask in chains:  # mask 0 drops pages: bitsets go back to pairs
        run = keys[first : first + n]
        word.set_chain(slot, run, first, keys[first - 1] if first else ROOT, mask)
        wide.set_chain(slot + 16, run, first, keys[first - 1] if first else ROOT, mask)
    for first, n in looked_up:
        run = keys[first : first + n]
        assert sorted(word.lookup(run)) == sorted((s - 16, m, d) for s, m, d in wide.lookup(run))
