"""The hot-prefix replication policy (kvfabric.core.index.replication): what makes a prefix
hot, where its copies go, the budget, cold replicas dropped first; and, over random
events, that it never breaks its bounds and is deterministic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.core.index.replication import (
    Drop,
    Replicate,
    ReplicationConfig,
    ReplicationPolicy,
)

NODES = ("a", "b", "c", "d")


def chain(*names: str) -> tuple[bytes, ...]:
    """Chained keys: each names its whole prefix."""
    return tuple("/".join(names[: i + 1]).encode() for i in range(len(names)))


HOT = chain("sys", "p1", "p2")


class World:
    """Who holds what: the fetch source, readers once they fetched, replicas once placed."""

    def __init__(self, held: dict[str, set[bytes]] | None = None) -> None:
        self.held = held or {n: set() for n in NODES}

    def holders(self, keys):
        return sorted(n for n, ends in self.held.items() if keys[-1] in ends)

    def apply(self, decisions):
        for d in decisions:
            if isinstance(d, Replicate):
                self.held[d.target].add(d.keys[-1])


def policy(**kw) -> ReplicationPolicy:
    return ReplicationPolicy(ReplicationConfig(**kw), dict.fromkeys(NODES, 100))


def test_a_prefix_fetched_threshold_times_is_copied_to_nodes_that_lack_it():
    p, w = policy(threshold=3, window_s=10, fanout=4), World()
    w.held["a"] = {HOT[-1]}
    for t, reader in enumerate(("b", "c")):
        p.fetched(t, HOT + chain("sys", "p1", "p2", f"u{t}")[3:], "a", reader)
        w.held[reader].add(HOT[-1])
        assert p.decide(t, w.holders) == []  # under the threshold
    p.fetched(2, HOT, "a", "b")
    got = p.decide(2, w.holders)
    # The deepest prefix every fetch passed through, to the one node that lacks it.
    assert got == [Replicate(HOT, "a", "d")]
    assert p.used["d"] == 3 and p.decide(2.5, w.holders) == []  # already placed


def test_fetches_outside_the_window_do_not_count():
    p, w = policy(threshold=2, window_s=5), World({"a": {HOT[-1]}, "b": set(), "c": set()})
    p.fetched(0, HOT, "a", "b")
    p.fetched(6, HOT, "a", "c")
    assert p.decide(6, w.holders) == []
    p.fetched(7, HOT, "a", "b")
    assert [d.target for d in p.decide(7, w.holders)] == ["b", "c"]


def test_the_budget_bounds_each_node_and_fanout_each_decision():
    p = policy(threshold=1, budget_pages=4, fanout=2)
    w = World({"a": {HOT[-1]}, "b": set(), "c": set(), "d": set()})
    p.fetched(0, HOT, "a", "b")
    assert [d.target for d in p.decide(0, w.holders)] == ["b", "c"]  # fanout 2, by name
    other = chain("x", "y")
    w.held["a"].add(other[-1])
    p.fetched(1, other, "a", "d")
    got = p.decide(1, w.holders)
    # HOT's third copy goes to d (least used); `other` (2 pages) fits nowhere with room 4:
    # b and c hold 3, d now holds 3 too.
    assert got == [Replicate(HOT, "a", "d")]
    assert max(p.used.values()) <= 4
    assert p.decide(2, w.holders) == []


def test_a_budget_fraction_is_of_each_nodes_capacity():
    cfg = ReplicationConfig(budget_fraction=0.25)
    assert ReplicationPolicy(cfg, {"a": 100, "b": 10}).budgets == {"a": 25, "b": 2}
    assert ReplicationConfig(budget_pages=50).budget(20) == 20


def test_cold_replicas_are_dropped_and_hit_ones_kept():
    p = policy(threshold=1, window_s=10, fanout=2)
    w = World({"a": {HOT[-1]}, "b": set(), "c": set(), "d": set()})
    p.fetched(0, HOT, "a", "d")
    w.held["d"].add(HOT[-1])
    assert [d.target for d in p.decide(0, w.holders)] == ["b", "c"]
    p.hit(8, "b", HOT + chain("sys", "p1", "p2", "q")[3:])  # covers the replica whole
    p.hit(9, "c", HOT[:2])  # covers part of it: not a hit of the replica
    assert p.decide(15, w.holders) == [Drop(HOT, "c")]
    assert p.used == {"a": 0, "b": 3, "c": 0, "d": 0}
    assert p.decide(19, w.holders) == [Drop(HOT, "b")]


def test_lost_replicas_give_their_budget_back_and_off_means_nothing():
    p = policy(threshold=1, budget_pages=3, fanout=1)
    w = World({"a": {HOT[-1]}, "b": set(), "c": set(), "d": set()})
    p.fetched(0, HOT, "a", "c")
    assert p.decide(0, w.holders) == [Replicate(HOT, "a", "b")]
    p.lost("b", HOT)
    assert p.used["b"] == 0
    off = policy(enabled=False, threshold=1)
    off.fetched(0, HOT, "a", "b")
    assert off.decide(0, w.holders) == [] and not off.replicas


def test_the_source_is_a_node_that_still_holds_the_prefix():
    p = policy(threshold=1, fanout=1)
    w = World({"a": set(), "b": {HOT[-1]}, "c": set(), "d": set()})
    p.fetched(0, HOT, "a", "c")  # a has lost it since
    assert p.decide(0, w.holders) == [Replicate(HOT, "b", "a")]  # a lacks it now too
    assert p.decide(1, World().holders) == []  # nobody holds the hot prefix: nothing to copy


@pytest.mark.parametrize(
    "kw",
    [
        {"threshold": 0},
        {"window_s": 0},
        {"window_s": float("inf")},
        {"budget_pages": -1},
        {"budget_fraction": 1.5},
        {"fanout": 0},
        {"min_pages": True},
    ],
)
def test_config_validation(kw):
    with pytest.raises(ValueError):
        ReplicationConfig(**kw)


# --- random events ------------------------------------------------------------------------
PREFIXES = [chain("s"), chain("s", "x"), chain("s", "x", "y"), chain("t", "u"), chain("s", "z")]
event = st.one_of(
    st.tuples(
        st.just("fetch"),
        st.sampled_from(PREFIXES),
        st.sampled_from(NODES),
        st.sampled_from(NODES),
    ),
    st.tuples(st.just("hit"), st.sampled_from(PREFIXES), st.sampled_from(NODES)),
    st.tuples(st.just("lose"), st.sampled_from(PREFIXES), st.sampled_from(NODES)),
    st.tuples(st.just("decide")),
)


def run(events, steps, config):
    """Play `events` at clock times from `steps`; returns the decisions, checking the
    bounds after each."""
    p = ReplicationPolicy(config, {"a": 8, "b": 5, "c": 3, "d": 0})
    w = World({n: {PREFIXES[0][-1]} if n == "a" else set() for n in NODES})
    now, out = 0.0, []
    for ev, dt in zip(events, steps):
        now += dt
        kind = ev[0]
        if kind == "fetch":
            _, keys, source, reader = ev
            p.fetched(now, keys, source, reader)
            w.held[reader].add(keys[-1])
        elif kind == "hit":
            p.hit(now, ev[2], ev[1])
        elif kind == "lose":
            w.held[ev[2]].discard(ev[1][-1])
            p.lost(ev[2], ev[1])
        else:
            before = {n: set(e) for n, e in w.held.items()}
            got = p.decide(now, w.holders)
            for d in got:
                if isinstance(d, Replicate):
                    holders = {n for n, e in before.items() if d.keys[-1] in e}
                    assert d.target not in holders and d.target != d.source
                    assert d.source in holders
            w.apply(got)
            out.append(got)
        for n, used in p.used.items():
            assert 0 <= used <= p.budgets[n]
            assert used == sum(len(r.keys) for r in p.replicas.values() if r.node == n)
    return out


@given(
    st.lists(event, max_size=60),
    st.lists(st.floats(0, 5, allow_nan=False), min_size=60, max_size=60),
    st.integers(1, 4),
    st.floats(0.5, 20),
    st.integers(1, 4),
)
def test_random_events_keep_the_bounds_and_replay_identically(
    events, steps, threshold, window_s, fanout
):
    config = ReplicationConfig(
        threshold=threshold, window_s=window_s, budget_fraction=0.5, fanout=fanout
    )
    assert run(events, steps, config) == run(events, steps, config)
