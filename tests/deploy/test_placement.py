"""kvfabric.deploy.placement: the cost model's fetch plan, the fabric's score, and the model of Ray
Serve LLM's PrefixCacheAffinityRouter, checked against Ray's own prefix tree."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.core.cache.layout import KVLayout, PoolName, Tier
from kvfabric.deploy.placement import (
    CostModel,
    FabricScore,
    NodeView,
    PageBytes,
    PowerOfTwo,
    PrefixAffinity,
    Prompt,
    Request,
    plan,
)

from tests.examples import examples

COST = CostModel(prefill_tokens_per_s=10_000.0, transfer_bytes_per_s=10e9, fetch_overhead_s=0.002)
SIZES = PageBytes.full(512 * 131_072)


def request(blocks: list[int], page_tokens: int = 1, tokens: int | None = None) -> Request:
    """A prompt of one page per block; a page's key names its whole prefix."""
    keys = [repr(blocks[: j + 1]).encode() for j in range(len(blocks))]
    return Request(
        Prompt(len(blocks) * page_tokens if tokens is None else tokens, page_tokens), keys
    )


# ---- the fetch plan -------------------------------------------------------------------------


@settings(max_examples=examples(200), deadline=None)
@given(
    st.integers(1, 200),
    st.integers(0, 200),
    st.integers(0, 200),
    st.floats(1e2, 1e6),
    st.floats(1e6, 1e12),
    st.floats(0, 1.0),
)
def test_a_fetch_is_planned_exactly_when_it_beats_recomputing(
    pages, have, best, rate, bw, overhead
):
    have, best = min(have, pages), min(best, pages)
    cost = CostModel(rate, bw, overhead)
    prompt = Prompt(pages * 512 - 100, 512)
    p = plan(cost, SIZES, prompt, have, best)
    extra = prompt.hit_tokens(best) - prompt.hit_tokens(have)
    worth = best > have and cost.should_fetch(extra, SIZES.fetch(best - have))
    assert p.cached_pages == (best if worth else have) and (p.fetched_pages > 0) == worth
    assert p.fetched_bytes == SIZES.fetch(p.fetched_pages)
    recompute_all = cost.recompute_s(prompt.tokens - prompt.hit_tokens(have))
    assert p.seconds <= recompute_all + 1e-12  # a plan never costs more than not fetching
    assert p.prefill_s == pytest.approx(
        cost.recompute_s(prompt.tokens - prompt.hit_tokens(p.cached_pages))
    )


def test_swa_pages_count_once_per_window():
    layout = KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=1, page_size=2, window=6)
    full, swa = layout.page_bytes(PoolName.FULL), layout.page_bytes(PoolName.SWA)
    sizes = PageBytes.of(layout)  # a window of 6 tokens: 3 pages of 2
    assert [sizes.fetch(n) for n in (0, 1, 3, 5)] == [
        0,
        full + swa,
        3 * (full + swa),
        5 * full + 3 * swa,
    ]


# ---- the fabric's score ---------------------------------------------------------------------

views = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 30)), min_size=1, max_size=8)


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(views, st.floats(0, 5)), min_size=1, max_size=6), st.integers(1, 30))
def test_the_score_ranks_every_node_by_expected_first_token(rounds, pages):
    score = FabricScore(COST, SIZES, overhead_s=0.005)
    now = 0.0
    for raw, gap in rounds:
        now += gap
        req = Request(Prompt(pages * 512, 512), at_s=now)
        nodes = [NodeView(q, min(c, pages), f"n{i}") for i, (q, c) in enumerate(raw)]
        wait = [score.backlog_s(v.name, now) for v in nodes]
        order = score.rank(req, nodes)
        assert sorted(order) == list(range(len(nodes)))
        best = max(v.cached_pages for v in nodes)
        own = [0.005 + score.plan(req, v.cached_pages, best).seconds for v in nodes]
        expect = [wait[i] + own[i] for i in order]
        assert all(a <= b + 1e-12 for a, b in zip(expect, expect[1:]))
        # The router now expects the chosen node busy until this request's first token.
        assert score.backlog_s(nodes[order[0]].name, now) == pytest.approx(expect[0])


def test_the_score_forgets_replicas_that_are_gone():
    score = FabricScore(COST, SIZES)
    for gen in range(50):  # each round a new set of 3 replicas
        score.rank(
            Request(Prompt(512, 512), at_s=float(gen)),
            [NodeView(0, 0, f"r{gen}-{i}") for i in range(3)],
        )
    assert len(score.free_at) <= 2 * 3 + 1


def test_equal_nodes_take_cold_requests_in_turn():
    score = FabricScore(COST, SIZES)
    # Far apart in time: nothing sent earlier is still running, so every node is equal.
    firsts = [
        score.rank(
            Request(Prompt(1536, 512), at_s=100.0 * t), [NodeView(0, 0, f"n{i}") for i in range(4)]
        )[0]
        for t in range(8)
    ]
    assert firsts == [0, 1, 2, 3, 0, 1, 2, 3]


def test_the_holder_wins_when_idle_and_a_fetch_wins_when_it_is_busy():
    req = request(list(range(20)), page_tokens=512)  # 10,240 tokens: about 1 s to prefill
    nodes = [NodeView(0, 0, "a"), NodeView(0, 20, "b"), NodeView(0, 0, "c")]
    assert FabricScore(COST, SIZES).rank(req, nodes)[0] == 1
    # The router just sent the holder a cold request of about 1 s: another node fetches
    # the 20 pages (about 0.14 s) and prefills nothing sooner.
    score = FabricScore(COST, SIZES)
    assert score.rank(request(list(range(100, 120)), page_tokens=512), [NodeView(0, 0, "b")]) == [0]
    assert score.rank(req, nodes)[0] != 1
    # Many requests decoding there (a long queue) do not keep a request from its holder.
    assert FabricScore(COST, SIZES).rank(req, [NodeView(0, 0, "a"), NodeView(30, 20, "b")])[0] == 1


def test_a_hit_is_weighed_by_the_tier_it_lies_on_and_the_nodes_measured_disk():
    req = request(list(range(20)), page_tokens=512)  # 20 pages of 64 MiB: 1.3 GB
    tiers = [Tier.DISK, Tier.HOST, Tier.DEVICE]
    nodes = [NodeView(0, 20, f"n{t.name}", tier=t) for t in tiers]
    assert FabricScore(COST, SIZES).rank(req, nodes) == [2, 1, 0]  # equal hits: fastest tier
    # A longer hit on disk (0.27 s at the model's 5 GB/s) beats a shorter one on device
    # that would fetch the rest from that disk: the source reads it up too.
    disk, device = NodeView(0, 20, "d", tier=Tier.DISK), NodeView(0, 5, "g")
    assert FabricScore(COST, SIZES).rank(req, [device, disk])[0] == 1
    # The same disk hit where the node measured a slow disk (0.2 GB/s: 6.7 s to read) loses
    # to computing everything (about 1 s) on an idle node.
    slow = NodeView(0, 20, "d", tier=Tier.DISK, disk_read_bytes_per_s=0.2e9)
    assert FabricScore(COST, SIZES).rank(req, [NodeView(0, 0, "c"), slow])[0] == 0
    assert COST.load_s(Tier.DISK, 10**9, 0.2e9) == 5.0 and COST.load_s(Tier.DISK, 10**9) == 0.2


# ---- power of two choices -------------------------------------------------------------------


def test_power_of_two_picks_the_shorter_of_two_random_queues():
    router = PowerOfTwo(random.Random(1))
    nodes = [NodeView(q) for q in (5, 0, 3, 9)]
    for _ in range(50):
        a, b = router.rank(request([1]), nodes)
        assert a != b and nodes[a].queued <= nodes[b].queued


# ---- PrefixCacheAffinityRouter --------------------------------------------------------------


def test_affinity_sends_a_continuation_to_its_holder_whatever_its_queue():
    router = PrefixAffinity(random.Random(0))  # Ray's defaults: imbalanced_threshold inf
    first = request([1, 2, 3, 4])
    nodes = [NodeView(0)] * 3
    assert router.rank(first, nodes)[0] == 0  # all empty: the smallest, first on ties
    router.routed(first, 0)
    assert router.rank(request([7, 8]), nodes)[0] == 1  # no match: the smallest tenant
    later = request([1, 2, 3, 4, 5])
    assert router.rank(later, [NodeView(40), NodeView(0), NodeView(0)]) == [0]


def test_affinity_below_the_match_rate_goes_to_the_smallest_tenant():
    router = PrefixAffinity(random.Random(0))
    router.routed(request(list(range(10))), 0)
    router.routed(request([50, 51]), 1)
    # 1 page of 11 matched (9%): under 10%, so the smallest (node 2, empty).
    assert router.rank(request([0] + list(range(100, 110))), [NodeView(0)] * 3) == [2]
    # 2 of 11 (18%): the holder.
    assert router.rank(request([0, 1] + list(range(100, 109))), [NodeView(0)] * 3) == [0]


def test_affinity_falls_back_to_power_of_two_when_queues_are_uneven():
    router = PrefixAffinity(random.Random(0), imbalanced_threshold=2)
    router.routed(request([1, 2, 3]), 0)
    nodes = [NodeView(5), NodeView(0), NodeView(1)]
    for _ in range(20):
        order = router.rank(request([1, 2, 3, 4]), nodes)
        assert len(order) == 2 and nodes[order[0]].queued <= nodes[order[1]].queued
    assert router.rank(request([1, 2, 3, 4]), [NodeView(2), NodeView(0), NodeView(1)]) == [0]


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 5))
def test_affinity_matches_rays_prefix_tree(seed, tenants):
    """The same prompts routed to the same replicas: Ray's PrefixTree (one character per
    block) and the model (one page key per block) match the same length, name the same
    replicas, and find the same smallest ones."""
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

    rng = random.Random(seed)
    ray_tree, model = PrefixTree(), PrefixAffinity(random.Random(0))
    names = [str(t) for t in range(tenants)]
    ray_tree.add_tenants(names, 0.0)
    prompts: list[list[int]] = []
    for step in range(40):
        base = rng.choice(prompts) if prompts and rng.random() < 0.7 else []
        blocks = base[: rng.randrange(len(base) + 1)] + [
            rng.randrange(6) for _ in range(rng.randrange(1, 6))
        ]
        prompts.append(blocks)
        text = "".join(chr(97 + b) for b in blocks)
        req = request(blocks)
        matched, owners = ray_tree.prefix_match(text, names)
        depth, mine = model.match(req.keys, list(range(tenants)))
        assert (len(matched), [int(o) for o in owners]) == (depth, mine)
        assert [int(t) for t in ray_tree.get_smallest_tenants()] == model.smallest(
            list(range(tenants))
        )
        assert {int(t): n for t, n in ray_tree.tenant_to_char_count.items() if n} == {
            t: n for t, n in model.sizes.items() if n
        }
        to = rng.randrange(tenants)
        ray_tree.insert(text, names[to], float(step + 1))
        model.routed(req, to)


@pytest.mark.parametrize(
    "bad",
    [
        {"match_rate_threshold": 1.5},
        {"imbalanced_threshold": -1},
        {"match_rate_threshold": math.nan},
    ],
)
def test_affinity_rejects_bad_thresholds(bad):
    with pytest.raises(ValueError):
        PrefixAffinity(random.Random(0), **bad)
