"""NIXL transport between two real processes, plus the in-node copier.

The peer is a spawned process owning its own NIXL agent and pools filled from a seed;
this process reads from it and compares bytes with the same seeded fill. Pools live on
KVF_TEST_DEVICE (cpu by default; benchmarks/gpu_check.sh sets cuda).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import replace

import numpy as np
import pytest
import torch
from kvfabric.transport.base import (
    PeerDisconnected,
    PeerMetadata,
    PeerNotConnected,
    TransferAborted,
    TransferState,
    TransferTimeout,
    coalesce_order,
)
from kvfabric.transport.local import LocalTransport, copy_pages
from kvfabric.transport.nixl_transport import NixlTransport
from kvfabric.transport.runs import merge_runs, order_pairs

from tests.transport import child
from tests.waiting import eventually, stop_process

DEVICE = os.environ.get("KVF_TEST_DEVICE", "cpu")
# Two pools with different page sizes and dtypes; bytes are random, so compared as bits.
POOLS = {"kv": ((48, 2, 16, 64), torch.float16), "ssm": ((24, 3000), torch.float32)}
SEED = 1234
# UCX over tcp only, as between hosts (device memory needs cuda_copy to stage it).
TCP_TLS = "tcp" if DEVICE == "cpu" else "tcp,cuda_copy"
STARTUP_S = 60.0  # spawning imports torch and NIXL; generous on a loaded 2-core host


def make_pools(device: str, seed: int | None) -> dict[str, torch.Tensor]:
    """Seeded random bytes (seed) or zeros (None), shaped and typed as POOLS says."""
    pools = {}
    for i, (name, (shape, dtype)) in enumerate(POOLS.items()):
        nbytes = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
        if seed is None:
            raw = torch.zeros(nbytes, dtype=torch.uint8)
        else:
            gen = torch.Generator().manual_seed(seed + i)
            raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        pools[name] = raw.view(dtype).reshape(shape).to(device)
    return pools


def serve_peer(conn, name: str, device: str, env: dict[str, str]) -> None:
    """Child process: expose seeded pools until told to quit or orphaned."""
    os.environ.update(env)  # UCX reads its environment when the agent starts
    parent = os.getppid()
    transport = NixlTransport(name)
    pools = make_pools(device, SEED)
    for pool, tensor in pools.items():
        transport.register_pool(pool, tensor)
    conn.send(transport.metadata())
    while os.getppid() == parent:
        if conn.poll(0.2):
            try:
                if conn.recv() == "quit":
                    break
            except EOFError:
                break
    transport.close()


class Peer:
    def __init__(self, env: dict[str, str] | None = None, name: str | None = None) -> None:
        self.name = name or f"peer-{uuid.uuid4().hex[:8]}"
        self.proc, self.conn = child.spawn(serve_peer, self.name, DEVICE, env or {})
        try:
            if not self.conn.poll(STARTUP_S):
                raise TimeoutError(f"peer {self.name} did not start within {STARTUP_S} s")
            self.metadata: bytes = self.conn.recv()
        except BaseException:
            self.stop()
            raise

    def signal(self, sig: int) -> None:
        if sig == signal.SIGSTOP:
            stop_process(self.proc.pid)  # every thread of it, not only the signal sent
        else:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.signal(signal.SIGCONT)  # a stopped child cannot act on "quit"
        child.stop(self.proc, self.conn, "quit", grace_s=5)


@pytest.fixture(autouse=True)
def hard_timeout():
    """Fail, rather than hang, if a transport ever ignores its deadline."""

    def expire(signum, frame):
        raise TimeoutError("test exceeded 60 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def device() -> str:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("KVF_TEST_DEVICE=cuda but CUDA is not available")
    return DEVICE


@pytest.fixture(scope="module")
def peer(device: str):
    p = Peer()
    yield p
    p.stop()


@pytest.fixture
def local(device: str):
    """A fresh transport with zeroed pools; returns (transport, pools)."""
    t = NixlTransport(f"local-{uuid.uuid4().hex[:8]}", telemetry=True)
    pools = make_pools(device, None)
    for name, tensor in pools.items():
        t.register_pool(name, tensor)
    yield t, pools
    t.close()


@pytest.fixture
def tcp(monkeypatch, device: str):
    """Local transport and peer over UCX tcp only, as between hosts: over shared memory
    or CMA a reader copies from a stopped peer by itself and never hangs."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    p = Peer(env={"UCX_TLS": TCP_TLS})
    t = NixlTransport(f"local-{uuid.uuid4().hex[:8]}")
    pools = make_pools(device, None)
    for name, tensor in pools.items():
        t.register_pool(name, tensor)
    t.connect(p.name, p.metadata)
    yield t, pools, p
    p.stop()
    t.close()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def assert_pages_equal(dst: torch.Tensor, dst_idx, src: torch.Tensor, src_idx) -> None:
    assert torch.equal(bits(dst[list(dst_idx)]), bits(src[list(src_idx)]))


# -- reads between two processes ---------------------------------------------------------


def test_scattered_and_contiguous_reads_of_two_pools(peer: Peer, local) -> None:
    t, pools = local
    t.connect(peer.name, peer.metadata)
    expected = make_pools("cpu", SEED)
    rng = np.random.default_rng(0)
    kv_r, kv_l = rng.permutation(48)[:20], rng.permutation(48)[:20]
    ssm_r, ssm_l = rng.permutation(24)[:9], rng.permutation(24)[:9]
    h = t.read(peer.name, {"kv": (kv_r, kv_l), "ssm": (ssm_r.tolist(), torch.tensor(ssm_l))})
    t.wait(h, 10.0)
    assert h.state is TransferState.DONE and h.pages == 29
    assert_pages_equal(pools["kv"], kv_l, expected["kv"], kv_r)
    assert_pages_equal(pools["ssm"], ssm_l, expected["ssm"], ssm_r)
    # NIXL merged exactly the runs we ordered for (one descriptor per contiguous run).
    assert h.backend_descriptors == h.descriptors

    h = t.read(peer.name, {"kv": (range(10, 42), range(0, 32)), "ssm": (range(24), range(24))})
    t.wait(h, 10.0)
    assert h.descriptors == 2 and h.backend_descriptors == 2
    assert_pages_equal(pools["kv"], range(32), expected["kv"], range(10, 42))
    assert torch.equal(bits(pools["ssm"]), bits(expected["ssm"]))


def test_reads_of_page_runs_land_right_in_as_many_descriptors_as_merged(peer: Peer, local) -> None:
    """Differential: NIXL's own merge of the ordered pages (its telemetry) against
    merge_runs, over seeded lists of contiguous stretches, shuffled; bytes checked."""
    t, pools = local
    t.connect(peer.name, peer.metadata)
    expected = make_pools("cpu", SEED)
    rng = np.random.default_rng(7)
    for _ in range(12):
        pairs: dict[int, int] = {}
        for _ in range(rng.integers(1, 6)):
            r0, l0, n = rng.integers(0, 48), rng.integers(0, 48), rng.integers(1, 10)
            for k in range(min(n, 48 - r0, 48 - l0)):
                pairs.setdefault(int(l0 + k), int(r0 + k))
        local_idx = rng.permutation(sorted(pairs))
        remote_idx = np.array([pairs[i] for i in local_idx])
        pools["kv"].zero_()
        h = t.read(peer.name, {"kv": (remote_idx, local_idx)})
        t.wait(h, 10.0)
        assert_pages_equal(pools["kv"], local_idx, expected["kv"], remote_idx)
        untouched = sorted(set(range(48)) - set(pairs))
        assert not bits(pools["kv"][untouched]).any()
        runs = merge_runs(*order_pairs(remote_idx, local_idx))
        assert h.descriptors == len(runs) == h.backend_descriptors


def test_empty_read_is_done_at_once(peer: Peer, local) -> None:
    t, _ = local
    t.connect(peer.name, peer.metadata)
    h = t.read(peer.name, {"kv": ([], [])})
    assert t.poll(h) and h.pages == 0


def test_bad_arguments_raise_before_anything_is_sent(peer: Peer, local) -> None:
    t, pools = local
    t.connect(peer.name, peer.metadata)
    ok = ([0, 1, 2], [3, 4, 5])
    bad_specs = [
        {"kv": ok, "nope": ok},  # unknown pool
        {"kv": ok, "ssm": ([24], [0])},  # remote index out of range
        {"kv": ok, "ssm": ([0], [-1])},  # local index out of range
        {"kv": ok, "ssm": ([0, 1], [0])},  # mismatched lengths
        {"kv": ok, "ssm": ([0, 1], [2, 2])},  # one local page written twice
        {"kv": ok, "ssm": ([0.5], [1])},  # not integers
        {"kv": ok, "ssm": [0, 1]},  # not a (remote, local) pair
    ]
    for spec in bad_specs:
        with pytest.raises(ValueError):
            t.read(peer.name, spec)
    with pytest.raises(PeerNotConnected):
        t.read("nobody", {"kv": ok})
    time.sleep(0.2)  # anything wrongly posted would have landed by now
    assert all(not bits(p).any() for p in pools.values()), "a rejected read wrote pages"


def test_connect_validates_metadata(peer: Peer, local) -> None:
    t, _ = local
    with pytest.raises(ValueError):
        t.connect("someone-else", peer.metadata)
    with pytest.raises(ValueError):
        t.connect(peer.name, b"not metadata")
    meta = PeerMetadata.from_bytes(peer.metadata)
    wrong = replace(meta, pools={**meta.pools, "kv": replace(meta.pools["kv"], page_bytes=8)})
    with pytest.raises(ValueError, match="pages"):
        t.connect(peer.name, wrong.to_bytes())
    assert t.peers() == []


def test_a_stopped_peers_read_is_given_up_and_held_until_it_completes(tcp) -> None:
    """Past its deadline a read is given up, not cancelled: the transport holds it and
    says it is not drained while the peer stays stopped; once it resumes, the read lands
    whole and `drained` says so."""
    t, pools, p = tcp
    spec = {"kv": (range(48), range(48))}
    t.wait(t.read(p.name, spec), 10.0)  # connection warmed up
    p.signal(signal.SIGSTOP)
    h = t.read(p.name, spec)
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        t.wait(h, 0.5)
    assert time.monotonic() - start >= 0.5  # not before its deadline (and it did return)
    assert h.state is TransferState.GIVEN_UP
    with pytest.raises(TransferAborted):
        t.poll(h)
    assert not t.drained(p.name)
    pools["kv"].zero_()
    p.signal(signal.SIGCONT)
    eventually(lambda: t.drained(p.name), "the given-up read drained", deadline_s=10.0)
    assert torch.equal(bits(pools["kv"]), bits(make_pools("cpu", SEED)["kv"]))  # it landed
    pools["kv"].zero_()
    h = t.read(p.name, spec)  # the connection survived
    t.wait(h, 10.0)
    assert torch.equal(bits(pools["kv"]), bits(make_pools("cpu", SEED)["kv"]))


def test_killed_peer_raises_peer_disconnected_and_can_rejoin(tcp) -> None:
    t, pools, p = tcp
    spec = {"ssm": (range(24), range(24))}
    t.wait(t.read(p.name, spec), 10.0)
    p.signal(signal.SIGSTOP)  # hold the next read in flight ...
    h = t.read(p.name, spec)
    assert not t.poll(h)
    p.proc.kill()  # ... and kill the peer under it
    p.proc.join(5)
    with pytest.raises(PeerDisconnected):
        t.wait(h, 10.0)
    assert h.state is TransferState.FAILED  # the death, not the 10 s deadline
    with pytest.raises(PeerDisconnected):
        t.wait(t.read(p.name, spec), 5.0)
    assert not t.drained(p.name)  # a failed request: held until the peer is disconnected
    reborn = Peer(env={"UCX_TLS": TCP_TLS}, name=p.name)  # restarted under its old name
    try:
        t.connect(reborn.name, reborn.metadata)  # another process: the old one's reads end
        assert t.drained(p.name)
        pools["ssm"].zero_()
        t.wait(t.read(reborn.name, spec), 10.0)
        assert torch.equal(bits(pools["ssm"]), bits(make_pools("cpu", SEED)["ssm"]))
    finally:
        reborn.stop()


# -- pure helpers --------------------------------------------------------------------------
def test_coalesce_order_counts_runs_contiguous_on_both_sides() -> None:
    r, l_, runs = coalesce_order(np.array([7, 3, 4, 5, 9]), np.array([0, 10, 11, 20, 1]))
    assert r.tolist() == [3, 4, 5, 7, 9] and l_.tolist() == [10, 11, 20, 0, 1]
    assert runs == 4  # 3-4 | 5 | 7 | 9 (8 is missing)
    assert coalesce_order(np.arange(5), np.arange(5, 10))[2] == 1
    assert coalesce_order(np.zeros(0, int), np.zeros(0, int))[2] == 0


def test_metadata_round_trip(peer: Peer) -> None:
    meta = PeerMetadata.from_bytes(peer.metadata)
    assert meta.name == peer.name and set(meta.pools) == set(POOLS)
    assert meta.pools["ssm"].page_bytes == 3000 * 4 and meta.pools["kv"].capacity == 48
    assert PeerMetadata.from_bytes(meta.to_bytes()) == meta


# -- copies inside one node ---------------------------------------------------------------


@pytest.mark.parametrize("src_dev,dst_dev", [("cpu", "dev"), ("dev", "cpu"), ("dev", "dev")])
def test_copy_pages_between_devices(device: str, src_dev: str, dst_dev: str) -> None:
    src = make_pools(device if src_dev == "dev" else "cpu", SEED)["kv"]
    dst = make_pools(device if dst_dev == "dev" else "cpu", None)["kv"]
    copy_pages(src, [5, 0, 47, 6], dst, [1, 2, 3, 40])
    assert_pages_equal(dst, [1, 2, 3, 40], src, [5, 0, 47, 6])
    untouched = [i for i in range(48) if i not in (1, 2, 3, 40)]
    assert not bits(dst[untouched]).any()


def test_local_transport_validates_and_accepts_pool_objects(device: str) -> None:
    class Pool:  # shaped like kvfabric.core.cache.pools.PagePool
        def __init__(self, data):
            self.data = data

    src, dst = make_pools(device, SEED), make_pools(device, None)
    copier = LocalTransport()
    copier.copy(Pool(src["ssm"]), torch.tensor([3, 4]), Pool(dst["ssm"]), np.array([0, 1]))
    assert_pages_equal(dst["ssm"], [0, 1], src["ssm"], [3, 4])
    copier.copy(Pool(None), [0], Pool(dst["ssm"]), [0])  # no storage: nothing to move
    with pytest.raises(ValueError):
        copier.copy(src["ssm"], [0, 1], dst["ssm"], [0])
    with pytest.raises(ValueError):
        copier.copy(src["ssm"], [24], dst["ssm"], [0])
    with pytest.raises(ValueError):
        copier.copy(src["kv"], [0], dst["ssm"], [0])
