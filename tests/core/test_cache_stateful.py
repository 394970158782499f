"""Random put / get / lock / unlock / evict / backup / load-back on small pools, with or
without a disk tier, and restarts that adopt the disk's pages; `check()` after every
step; failures injected at reservation points leave the state exactly as before; what
`get` returns equals what `put` stored, across restarts too."""

import random
import shutil
import tempfile

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvfabric.core.cache.check import PageAudit
from kvfabric.core.cache.disk_store import DiskStore
from kvfabric.core.cache.layout import KVLayout, PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.tiers import TierConfig, WritePolicy
from kvfabric.core.index.events import PageState
from kvfabric.core.index.events import decode as decode_events
from kvfabric.core.index.publisher import EventPublisher
from kvfabric.deploy.chaos.faults import AllocationFaults

from tests.kvgen import prefix_kv

LAYOUTS = {
    "mixed": KVLayout(layers=("full", "swa", "swa"), kv_heads=1, head_dim=2, page_size=2, window=3),
    "full": KVLayout(layers=("full", "full"), kv_heads=1, head_dim=2, page_size=2),
    "swa": KVLayout(layers=("swa",), kv_heads=1, head_dim=2, page_size=2, window=4),
}
NAMESPACES = ("a", "b")


def family(seed: int) -> list[list[int]]:
    """Sequences that share prefixes, as conversations do."""
    rng = random.Random(seed)
    roots = [[rng.randrange(50) for _ in range(rng.randrange(2, 8))] for _ in range(2)]
    out = []
    for _ in range(8):
        base = rng.choice(roots + out) if out else roots[0]
        cut = rng.randrange(len(base) + 1)
        out.append(base[:cut] + [rng.randrange(50) for _ in range(rng.randrange(1, 10))])
    return out


def small_capacities(layout: KVLayout, device: int, host: int) -> dict[PoolName, PoolCapacity]:
    """`device` pages for FULL and about half for SWA (at least 2), `host` for both."""
    return {
        p: PoolCapacity(device if p == PoolName.FULL else max(2, device // 2), host)
        for p in layout.pools
    }


# What a machine over small caches draws first: a layout, a write policy, the sequences'
# seed, device and host pages (see small_capacities).
SMALL_CACHE = dict(
    layout=st.sampled_from(sorted(LAYOUTS)),
    policy=st.sampled_from(list(WritePolicy)),
    seed=st.integers(0, 2**16),
    device=st.integers(3, 8),
    host=st.integers(0, 10),
)


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        **SMALL_CACHE,
        pending=st.sampled_from([0, 1024]),
        disk=st.sampled_from([0, 0, 3, 12]),
        to_disk=st.sampled_from([WritePolicy.WRITE_BACK, WritePolicy.WRITE_THROUGH]),
    )
    def setup(self, layout, policy, seed, device, host, pending, disk, to_disk):
        self.layout = LAYOUTS[layout]
        self.caps = {
            p: PoolCapacity(c.device, c.host, disk)
            for p, c in small_capacities(self.layout, device, host).items()
        }
        self.faults = AllocationFaults()
        self.tier = TierConfig(policy=policy, selective_hits=2, disk=to_disk)
        self.folder = tempfile.mkdtemp(prefix="kvf-disk-") if disk else None
        self.seqs = family(seed)
        self.pending = pending
        self.start()

    def start(self):
        """A cache (over the disk folder's pages, where there is one) and its publisher."""
        self.store = None
        if self.folder is not None:
            self.store = DiskStore(
                self.folder, self.layout, {p: c.disk for p, c in self.caps.items()}
            )
        self.cache = NodeCache(
            self.layout,
            self.caps,
            tier=self.tier,
            device="cpu",
            reserve_hook=self.faults,
            disk=self.store,
        )
        self.locks = []
        # pending=0: the change list overflows often and batches restate everything
        self.publisher = EventPublisher(self.cache, "node-a", epoch=1, pending_floor=self.pending)
        self.believed: dict[bytes, PageState] = {}  # what an index fed our events knows

    @precondition(lambda self: getattr(self, "store", None) is not None)
    @rule()
    def restart(self):
        """The process ends (its disk pages stay) and a new one adopts them."""
        primary = self.layout.pools[0]
        on_disk = {
            view.key: path
            for view, path in self.cache.held_pages_with_paths()
            if (primary, Tier.DISK) in view.held
        }
        self.store.close()
        self.start()
        # Every page the disk held is back, where its chain from page 0 was on disk too.
        whole = {key for key, path in on_disk.items() if all(k in on_disk for k in path)}
        assert whole <= {view.key for view in self.cache.held_pages()}

    def tokens(self, i):
        return self.seqs[i % len(self.seqs)]

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES))
    def put(self, i, ns):
        t = self.tokens(i)
        self.cache.put(t, prefix_kv(self.layout, t), ns)

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES), extra=st.integers(0, 5))
    def get(self, i, ns, extra):
        t = self.tokens(i) + list(range(100, 100 + extra))
        hit = self.cache.get(t, ns)
        assert hit.tokens % self.layout.page_size == 0 and hit.tokens <= len(t)
        if hit.tokens == 0:
            return
        want = prefix_kv(self.layout, t)
        for li, kind in enumerate(self.layout.layers):
            start = 0 if kind.value == "full" else hit.starts[PoolName.SWA]
            assert torch.equal(hit.layers[li], want[li][:, start : hit.tokens])

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES))
    def lock(self, i, ns):
        m = self.cache.match(self.tokens(i), ns)
        self.locks.append(self.cache.lock(m))

    @precondition(lambda self: self.locks)
    @rule(k=st.integers(0, 10))
    def unlock(self, k):
        self.cache.unlock(self.locks.pop(k % len(self.locks)))

    @rule(
        pool=st.sampled_from(list(PoolName)), tier=st.sampled_from(list(Tier)), n=st.integers(1, 6)
    )
    def evict(self, pool, tier, n):
        if pool in self.layout.pools:
            self.cache.evict(pool, tier, n)

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES))
    def backup(self, i, ns):
        self.cache.back_up(self.cache.match(self.tokens(i), ns))

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES), point=st.integers(1, 4))
    def failed_put_changes_nothing(self, i, ns, point):
        t = self.tokens(i)
        before = self.cache.snapshot()
        failures = self.cache.stats().put_failures
        self.faults.arm(point)
        self.cache.put(t, prefix_kv(self.layout, t), ns)
        self.faults.disarm()
        if self.cache.stats().put_failures > failures:
            assert self.cache.snapshot() == before

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES), point=st.integers(1, 4))
    def failed_load_back_changes_nothing(self, i, ns, point):
        m = self.cache.match(self.tokens(i), ns)
        if not m.usable_pages:
            return
        guard = self.cache.lock(m)
        before = self.cache.snapshot()
        injected = self.faults.injected
        self.faults.arm(point)
        ok = self.cache.load_to_device(m, m.usable_pages).pages == m.usable_pages
        fired = self.faults.injected > injected
        self.faults.disarm()
        if not ok and fired:
            assert self.cache.snapshot() == before
        self.cache.unlock(guard)

    @rule(i=st.integers(0, 7), ns=st.sampled_from(NAMESPACES), point=st.integers(1, 3))
    def failed_backup_changes_nothing(self, i, ns, point):
        match = self.cache.match(self.tokens(i), ns)
        before = self.cache.snapshot()
        injected = self.faults.injected
        self.faults.arm(point)
        ok = self.cache.back_up(match)
        fired = self.faults.injected > injected
        self.faults.disarm()
        if not ok and fired:
            assert self.cache.snapshot() == before

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "cache"):
            self.cache.check()
            assert self.cache.audit() == PageAudit(0, 0, 0)

    @invariant()
    def events_tell_the_truth(self):
        """Applying every drained batch yields exactly what the cache holds."""
        if not hasattr(self, "cache"):
            return
        batch = self.publisher.drain()
        if batch is not None:
            batch = decode_events(batch.encode())
            assert batch.seq == self.publisher.next_seq - 1
            if batch.cleared:
                self.believed = {}
            for page in batch.pages:
                if page.mask:
                    self.believed[page.key] = page
                else:
                    self.believed.pop(page.key, None)
        truth = {p.key: p for p in self.publisher.snapshot().pages}
        assert self.believed == truth

    def teardown(self):
        if hasattr(self, "cache"):
            for lock in self.locks:
                self.cache.unlock(lock)
            self.cache.check()
            for pool in self.layout.pools:  # with no locks, everything can go
                for tier in Tier:
                    self.cache.evict(pool, tier, 10_000)
            self.cache.check()
        if getattr(self, "store", None) is not None:
            self.store.close()
        if getattr(self, "folder", None) is not None:
            shutil.rmtree(self.folder)


TestCacheMachine = CacheMachine.TestCase
