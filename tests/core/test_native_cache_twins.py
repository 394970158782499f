"""NodeCache on the C tree and on the pure-Python reference (nodes.py), driven through the
same random put / get / match+lock / unlock / evict / back_up / load-back steps, with
injected reservation failures: results, snapshots, stats, whole-tree state and check()
must agree after every step. The tree's own primitives: test_native_radix.py."""

from unittest import mock

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kvfabric.core.cache import radix
from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.tiers import TierConfig
from kvfabric.deploy.chaos.faults import AllocationFaults

from tests.core.test_cache_stateful import (
    LAYOUTS,
    NAMESPACES,
    SMALL_CACHE,
    family,
    small_capacities,
)
from tests.core.test_native_radix import node_state, tree_state
from tests.examples import examples
from tests.kvgen import prefix_kv

pytestmark = pytest.mark.skipif(
    not radix.ENABLED, reason="KVF_NATIVE=0 or not built: the reference alone"
)


def python_cache(*args, **kwargs) -> NodeCache:
    """A NodeCache on the pure-Python tree, in a process that loaded the extension."""
    with mock.patch.object(radix, "EXT", None):
        cache = NodeCache(*args, **kwargs)
    assert not cache.tree.native
    return cache


class TwinCaches(RuleBasedStateMachine):
    @initialize(**SMALL_CACHE)
    def setup(self, layout, policy, seed, device, host):
        self.layout = LAYOUTS[layout]
        caps = small_capacities(self.layout, device, host)
        self.faults = [AllocationFaults(), AllocationFaults()]
        config = dict(tier=TierConfig(policy=policy, selective_hits=2), device="cpu")
        self.caches = [
            NodeCache(self.layout, caps, reserve_hook=self.faults[0], **config),
            python_cache(self.layout, caps, reserve_hook=self.faults[1], **config),
        ]
        assert self.caches[0].tree.native
        self.seqs = family(seed)
        self.locks: list[tuple] = []

    def both(self, call):
        a, b = (call(c) for c in self.caches)
        assert a == b
        return a

    def tokens(self, i):
        return self.seqs[i % len(self.seqs)]

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES), point=st.integers(0, 4))
    def put(self, i, ns, point):
        t = self.tokens(i)
        for f in self.faults:
            f.arm(point) if point else f.disarm()
        self.both(lambda c: (c.put(t, prefix_kv(self.layout, t), ns), c.stats().put_failures))
        for f in self.faults:
            f.disarm()

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES), extra=st.integers(0, 5))
    def get(self, i, ns, extra):
        t = self.tokens(i) + list(range(100, 100 + extra))
        hits = [c.get(t, ns) for c in self.caches]
        assert hits[0].tokens == hits[1].tokens and hits[0].starts == hits[1].starts
        for a, b in zip(hits[0].layers, hits[1].layers):
            assert (a is None and b is None) or torch.equal(a, b)

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES))
    def match_and_lock(self, i, ns):
        matches = [c.match(self.tokens(i), ns) for c in self.caches]
        assert matches[0].usable_pages == matches[1].usable_pages
        assert [node_state(n) for n in matches[0].path] == [node_state(n) for n in matches[1].path]
        self.locks.append(tuple(c.lock(m) for c, m in zip(self.caches, matches)))

    @rule(k=st.integers(0, 10))
    def unlock(self, k):
        if self.locks:
            for c, lock in zip(self.caches, self.locks.pop(k % len(self.locks))):
                c.unlock(lock)

    @rule(
        pool=st.sampled_from(list(PoolName)), tier=st.sampled_from(list(Tier)), n=st.integers(1, 6)
    )
    def evict(self, pool, tier, n):
        if pool in self.layout.pools:
            self.both(lambda c: c.evict(pool, tier, n))

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES))
    def backup(self, i, ns):
        self.both(lambda c: c.back_up(c.match(self.tokens(i), ns)))

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES), point=st.integers(0, 4))
    def load_back(self, i, ns, point):
        def call(c, faults):
            m = c.match(self.tokens(i), ns)
            guard = c.lock(m)
            faults.arm(point) if point else faults.disarm()
            loaded = c.load_to_device(m, m.usable_pages).pages
            faults.disarm()
            c.unlock(guard)
            return loaded

        assert call(self.caches[0], self.faults[0]) == call(self.caches[1], self.faults[1])

    @invariant()
    def same_state(self):
        if hasattr(self, "caches"):
            for c in self.caches:
                c.check()
            self.both(lambda c: (c.snapshot(), c.stats(), tree_state(c.tree)))


TestTwinCaches = TwinCaches.TestCase
TestTwinCaches.settings = settings(
    max_examples=examples(200), stateful_step_count=50, deadline=None
)
