"""A remote fetch between two processes over real NIXL agents: bytes equal,
and every fault kind at every step leaves both sides clean, after which a
clean retry succeeds."""

from __future__ import annotations

import os
import signal
import time
import uuid

import msgpack
import pytest
import torch
from kvfabric.core.cache.layout import KVLayout, PoolName, Tier
from kvfabric.core.cache.leases import LeaseTable
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.exchange.destination import FetchOutcome, import_prefix
from kvfabric.core.exchange.grant import ExportGrant
from kvfabric.core.exchange.source import export_prefix
from kvfabric.deploy.chaos.faults import Fault, FaultKind, FaultPlan, FaultyTransport
from kvfabric.transport.fetch import TransportReader, register_device_pools
from kvfabric.transport.nixl_transport import NixlTransport

from tests.kvgen import prefix_kv
from tests.transport import child
from tests.waiting import eventually, stop_process

LAYOUT = KVLayout(layers=("full", "swa", "full"), kv_heads=2, head_dim=64, page_size=16, window=32)
CAPS = {PoolName.FULL: PoolCapacity(64, 0), PoolName.SWA: PoolCapacity(32, 0)}
NS = "tenant"
TOKENS = list(range(1000, 1000 + 8 * 16))  # 8 pages
STARTUP_S = 90.0


def source_main(conn, name: str, env: dict[str, str]) -> None:
    """The source node: a cache with the prefix, exporting under leases."""
    os.environ.update(env)  # UCX reads its environment when the agent starts
    parent = os.getppid()
    cache = NodeCache(LAYOUT, CAPS, device="cpu")
    transport = NixlTransport(name)
    register_device_pools(transport, cache)
    leases = LeaseTable(cache)
    cache.put(TOKENS, prefix_kv(LAYOUT, TOKENS), NS)
    conn.send(transport.metadata())
    while os.getppid() == parent:
        if not conn.poll(0.2):
            continue
        cmd, *args = conn.recv()
        if cmd == "export":
            keys, skip, ttl = args
            conn.send(msgpack.packb(export_prefix(cache, leases, keys, skip, ttl).to_wire()))
        elif cmd == "release":
            conn.send(leases.release(args[0]))
        elif cmd == "state":
            leases.expire()
            cache.check()
            conn.send((len(leases), cache.stats().pools["FULL/DEVICE"]["protected"]))
        elif cmd == "quit":
            break
    transport.close()


class Source:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.name = f"src-{uuid.uuid4().hex[:8]}"
        self.proc, self.conn = child.spawn(source_main, self.name, env or {})
        if not self.conn.poll(STARTUP_S):
            self.stop()
            raise TimeoutError("source did not start")
        self.metadata = self.conn.recv()

    def ask(self, *msg, timeout: float = 30.0):
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"source did not answer {msg[0]}")
        return self.conn.recv()

    def kill(self, _peer: str = "") -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        child.stop(self.proc, self.conn, ("quit",), grace_s=10)


@pytest.fixture(scope="module")
def source():
    src = Source()
    yield src
    src.stop()


def destination(source: Source, script=(), kill=None, clock=time.monotonic):
    cache = NodeCache(LAYOUT, CAPS, device="cpu", clock=clock)
    nixl = NixlTransport(f"dst-{uuid.uuid4().hex[:8]}")
    plan = FaultPlan(script)
    transport = FaultyTransport(nixl, plan, kill_peer=kill)
    register_device_pools(transport, cache)
    transport.connect(source.name, source.metadata)
    return cache, transport, plan


def fetch(cache, transport, source, deadline_s=2.0):
    keys = cache.keys(TOKENS, NS)
    skip = cache.match(TOKENS, NS).present_pages
    grant = ExportGrant.from_wire(msgpack.unpackb(source.ask("export", keys, skip, 5.0)))
    outcome = import_prefix(
        cache,
        TOKENS,
        NS,
        grant,
        TransportReader(transport, source.name, deadline_s),
        peer=source.name,
    )
    if grant.lease_id:
        source.ask("release", grant.lease_id)
    return outcome


def assert_fetched(cache):
    hit = cache.get(TOKENS, NS)
    assert hit.tokens == len(TOKENS)
    want = prefix_kv(LAYOUT, TOKENS)
    for i, kind in enumerate(LAYOUT.layers):
        start = 0 if kind.value == "full" else hit.starts[PoolName.SWA]
        assert torch.equal(hit.layers[i], want[i][:, start : hit.tokens])


def test_fetch_full_and_swa_pages_bit_for_bit(source):
    cache, transport, _ = destination(source)
    try:
        assert fetch(cache, transport, source) == FetchOutcome.COMMITTED
        assert_fetched(cache)
        cache.check()
        assert source.ask("state") == (0, 0)
    finally:
        transport.close()


FAULTS = {
    "fail_after_0_full": ([Fault(FaultKind.FAIL_AFTER, after=0)], FetchOutcome.TRANSFER_FAILED),
    "fail_after_5_full": ([Fault(FaultKind.FAIL_AFTER, after=5)], FetchOutcome.TRANSFER_FAILED),
    "fail_after_1_swa": (
        [None, Fault(FaultKind.FAIL_AFTER, after=1)],
        FetchOutcome.TRANSFER_FAILED,
    ),
    "hang_full": ([Fault(FaultKind.HANG)], FetchOutcome.TRANSFER_FAILED),
    "hang_swa": ([None, Fault(FaultKind.HANG)], FetchOutcome.TRANSFER_FAILED),
    "corrupt_full": ([Fault(FaultKind.CORRUPT)], FetchOutcome.CHECKSUM_MISMATCH),
    "corrupt_swa": ([None, Fault(FaultKind.CORRUPT)], FetchOutcome.CHECKSUM_MISMATCH),
    "peer_death_reported": ([Fault(FaultKind.PEER_DEATH)], FetchOutcome.TRANSFER_FAILED),
    "slow_but_in_time": ([Fault(FaultKind.DELAY, delay_s=0.05)], FetchOutcome.COMMITTED),
}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_each_fault_rolls_back_then_retry_succeeds(source, name):
    script, expected = FAULTS[name]
    cache, transport, plan = destination(source, script)
    try:
        before = cache.snapshot()
        assert fetch(cache, transport, source, deadline_s=0.5) == expected
        assert plan.injected
        if expected != FetchOutcome.COMMITTED:
            if cache.quarantined:  # given up: refused until the transport says it ended
                assert fetch(cache, transport, source) == FetchOutcome.PEER_QUARANTINED
                eventually(lambda: transport.drained(source.name), "drained", deadline_s=5.0)
                cache.release_quarantine(source.name)
            assert cache.snapshot() == before and not cache.quarantined
            cache.check()
            assert source.ask("state") == (0, 0)  # lease released, nothing pinned
            assert fetch(cache, transport, source) == FetchOutcome.COMMITTED
        assert_fetched(cache)
        cache.check()
    finally:
        transport.close()


def test_a_hung_read_holds_its_pages_until_it_ends(source):
    """A read given up at its deadline keeps its pages quarantined, whatever the clock says,
    until the transport sees it end (the hang's peer resumes a second later)."""
    now = [0.0]
    cache, transport, _ = destination(
        source, [Fault(FaultKind.HANG, delay_s=1.0)], clock=lambda: now[0]
    )
    try:
        before = cache.snapshot()
        assert fetch(cache, transport, source, deadline_s=0.2) == FetchOutcome.TRANSFER_FAILED
        held = sum(len(i) for q in cache.quarantined for i in q.pages.values())
        now[0] += 3600.0
        assert held and not transport.drained(source.name)
        assert fetch(cache, transport, source) == FetchOutcome.PEER_QUARANTINED
        eventually(lambda: transport.drained(source.name), "the hang ended", deadline_s=10.0)
        assert cache.release_quarantine(source.name) == held
        assert cache.snapshot() == before
        assert fetch(cache, transport, source) == FetchOutcome.COMMITTED
        assert_fetched(cache)
    finally:
        transport.close()


def test_peer_killed_mid_fetch_leaves_destination_clean():
    src = Source()
    cache, transport, _ = destination(src, [Fault(FaultKind.PEER_DEATH)], kill=src.kill)
    try:
        keys = cache.keys(TOKENS, NS)
        grant = ExportGrant.from_wire(msgpack.unpackb(src.ask("export", keys, 0, 5.0)))
        before = cache.snapshot()
        outcome = import_prefix(cache, TOKENS, NS, grant, TransportReader(transport, src.name, 2.0))
        assert outcome == FetchOutcome.TRANSFER_FAILED
        cache.release_quarantine(force=True)
        assert cache.snapshot() == before
        cache.check()
    finally:
        transport.close()
        src.stop()


def test_stopped_source_keeps_pages_quarantined_until_its_reads_complete(monkeypatch):
    """A hung peer may land a given-up read's bytes whenever it resumes (seen over UCX
    tcp): its pages stay quarantined however long it stays stopped (connecting it again
    with the same metadata changes nothing), fetches from it are refused meanwhile, and
    once it resumes the transport sees the read itself complete and they are freed."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # shared memory would read a stopped peer's pages
    src = Source(env={"UCX_TLS": "tcp"})
    now = [0.0]
    cache, transport, _ = destination(src, clock=lambda: now[0])
    try:
        transport.wait(transport.read(src.name, {"full": ([0], [0])}), 30.0)  # connection up
        grant = ExportGrant.from_wire(
            msgpack.unpackb(src.ask("export", cache.keys(TOKENS, NS), 0, 60.0))
        )
        before = cache.snapshot()
        stop_process(src.proc.pid)  # every thread, before the read is asked
        outcome = import_prefix(
            cache, TOKENS, NS, grant, TransportReader(transport, src.name, 0.5), peer=src.name
        )
        assert outcome == FetchOutcome.TRANSFER_FAILED
        held = [q.pages for q in cache.quarantined]
        assert held and cache.snapshot() == before
        now[0] += 3600.0  # far past any hold time: still quarantined
        assert cache.release_quarantine() == 0 and [q.pages for q in cache.quarantined] == held
        assert not transport.drained(src.name)  # still stopped: no release
        transport.connect(src.name, src.metadata)  # the same process: its reads stay held
        assert not transport.drained(src.name)
        assert (
            import_prefix(
                cache, TOKENS, NS, grant, TransportReader(transport, src.name, 0.5), peer=src.name
            )
            == FetchOutcome.PEER_QUARANTINED
        )
        quarantined = {(pool, i) for pages in held for (pool, _), idx in pages.items() for i in idx}
        outside = {
            e.name: [i for i in range(e.device.capacity) if (e.name, i) not in quarantined]
            for e in cache.registry
        }
        untouched = {
            p: cache.registry.pool(p, Tier.DEVICE).data[i].clone() for p, i in outside.items()
        }
        os.kill(src.proc.pid, signal.SIGCONT)
        eventually(lambda: transport.drained(src.name), "the given-up reads ended", deadline_s=30.0)
        assert cache.release_quarantine(src.name) == sum(len(i) for p in held for i in p.values())
        for pool, indices in outside.items():  # late bytes landed only in quarantine
            assert torch.equal(
                cache.registry.pool(pool, Tier.DEVICE).data[indices], untouched[pool]
            )
        assert cache.snapshot() == before and not cache.quarantined
        src.ask("release", grant.lease_id)
        assert fetch(cache, transport, src) == FetchOutcome.COMMITTED
        assert_fetched(cache)
        cache.check()
    finally:
        os.kill(src.proc.pid, signal.SIGCONT)
        transport.close()
        src.stop()
