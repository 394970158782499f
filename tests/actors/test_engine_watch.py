"""An engine that ends without a word: its node drops what it kept for it, and the index
forgets that life of the engine, never a later one.

First the node side alone (its EngineHost over real processes and staging files):
a watched process that exits, or whose PID another process took, is reaped; bad
announcements are refused and change nothing. Then the whole path on a Ray cluster: a
process announced to a real node actor, its device cache published to the real index
shards as vLLM engines publish theirs, killed; the directory's next passes clear its
entries, a second life of the same name publishes and stays, a node's engines go with it."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from functools import partial
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.actors.node.engine_host import EngineHost
from kvfabric.actors.node.engine_process import (
    EngineProcess,
    EngineProcessError,
    can_watch,
    process_start,
)
from kvfabric.core.cache.layout import PoolName
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.transport.staging import SHM_DIR, StagingPages, StagingSpec

from tests.examples import examples
from tests.waiting import eventually as wait_for

pytestmark = pytest.mark.skipif(not can_watch(), reason="engines are watched through /proc (Linux)")

NODE_NAME = "kvf-node-0123456789ab"
T = 60.0


eventually = partial(wait_for, deadline_s=T, every_s=0.1)


def sleeper() -> subprocess.Popen:
    """A process standing in for an engine: it lives until killed."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def spec() -> StagingSpec:
    return StagingSpec(f"kvf-test-watch-{uuid.uuid4().hex[:8]}", 4)


def engine_host(layout) -> EngineHost:
    """A node's EngineHost with no cache: watching engines never touches it."""
    return EngineHost(NODE_NAME, layout, None, None, None, lambda: 0)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def layout():
    pytest.importorskip("vllm")
    from tests.deploy.vllm.events.test_engine_pages import LAYOUT

    return LAYOUT


def test_an_ended_engine_is_reaped_once_and_its_staging_unlinked(layout):
    host, proc, staging = engine_host(layout), sleeper(), spec()
    try:
        StagingPages(staging, layout)  # the engine's worker made its files
        host.engine_started(
            EngineProcess(proc.pid, process_start(proc.pid), staging, f"{NODE_NAME}/engine/a", 3)
        )
        assert host.reap_engines() == {} and host.watched_engines() == [proc.pid]
        proc.kill()
        proc.wait(timeout=T)
        assert host.reap_engines() == {f"{NODE_NAME}/engine/a": 3}
        assert not any(staging.path(p).exists() for p in layout.pools)
        # Named until the directory says it retired that life; a stale word changes nothing.
        host.engines_retired({f"{NODE_NAME}/engine/a": 2})
        assert host.reap_engines() == {f"{NODE_NAME}/engine/a": 3}
        host.engines_retired({f"{NODE_NAME}/engine/a": 3})
        assert host.reap_engines() == {} and host.watched_engines() == []
    finally:
        proc.kill()


def test_an_engines_staging_is_mapped_as_it_announces_itself(layout):
    """The node maps an engine's staging pages when the engine starts, where its workers
    made them already (the engine's first load or save waited out the mapping before);
    files not made yet are left to the first use, and none is created for them."""
    host, made, missing = engine_host(layout), spec(), spec()
    me = os.getpid()
    try:
        StagingPages(made, layout)  # the engine's worker made its files
        host.engine_started(EngineProcess(me, process_start(me), missing))
        assert host.staging_use() == (0, 0)
        assert not any(missing.path(p).exists() for p in layout.pools)
        host.engine_started(EngineProcess(me, process_start(me), made))
        count, nbytes = host.staging_use()
        assert count == 1 and nbytes == made.bytes_needed(layout)
    finally:
        for s in (made, missing):
            host.drop_staging(s)
            for p in layout.pools:
                s.path(p).unlink(missing_ok=True)


def test_a_reused_pid_is_another_process(layout):
    host, proc = engine_host(layout), sleeper()
    try:
        # Announced with a start time that is not this process's: the engine it named is gone.
        host.engine_started(
            EngineProcess(proc.pid, process_start(proc.pid) + 1, spec(), f"{NODE_NAME}/engine/b", 1)
        )
        assert host.reap_engines() == {f"{NODE_NAME}/engine/b": 1}
        assert EngineProcess.this_process(spec()).alive()
    finally:
        proc.kill()


def unchecked_spec(prefix, pages) -> StagingSpec:
    """A StagingSpec as unpickling makes one from a caller's bytes: no constructor check."""
    spec = object.__new__(StagingSpec)
    object.__setattr__(spec, "prefix", prefix)
    object.__setattr__(spec, "pages", pages)
    return spec


ANNOUNCEMENTS = st.builds(
    EngineProcess,
    pid=st.one_of(st.integers(-5, 1 << 40), st.none(), st.booleans(), st.text(max_size=3)),
    started=st.one_of(st.integers(-5, 1 << 40), st.floats(), st.none()),
    staging=st.one_of(
        st.builds(
            unchecked_spec,
            st.one_of(st.text(max_size=12), st.just("../../tmp/x"), st.just("kvf-ok")),
            st.one_of(st.integers(-1, 4), st.none()),
        ),
        st.none(),
        st.just("x"),
    ),
    index_name=st.one_of(
        st.just(""),
        st.just(f"{NODE_NAME}/engine/c"),
        st.just("kvf-node-ffffffffffff/engine/c"),
        st.text(max_size=8),
        st.just("x" * 300),
        st.integers(),
    ),
    index_epoch=st.one_of(st.integers(-3, 1 << 63), st.none(), st.floats()),
)


@settings(max_examples=examples(200), deadline=None)
@given(ann=st.one_of(ANNOUNCEMENTS, st.none(), st.integers(), st.text(max_size=4)))
def test_an_announcement_is_validated_and_a_refused_one_changes_nothing(ann):
    host = engine_host(SimpleNamespace(pools=(PoolName.FULL,), fingerprint=b"\0" * 16))
    try:
        host.engine_started(ann)
    except EngineProcessError:
        assert host.watched_engines() == []
        return
    # Accepted: an engine of this node, watched under its pid, its staging a file of
    # the shared-memory folder.
    assert isinstance(ann, EngineProcess) and host.watched_engines() == [ann.pid]
    assert ann.staging.path(PoolName.FULL).parent == SHM_DIR and ann.staging.pages > 0
    assert ann.index_name == "" or ann.index_name.startswith(NODE_NAME + "/")
    assert ann.pid > 0 and ann.started >= 0 and ann.index_epoch >= 0


def test_only_so_many_engines_are_watched(layout):
    from kvfabric.actors.node.engine_host import MAX_ENGINES

    host = engine_host(layout)
    for pid in range(1, MAX_ENGINES + 1):
        host.engine_started(EngineProcess(pid, 0, spec()))
    with pytest.raises(EngineProcessError, match="watched already"):
        host.engine_started(EngineProcess(MAX_ENGINES + 1, 0, spec()))
    host.engine_started(EngineProcess(1, 5, spec()))  # the same pid again: replaced, not added
    assert len(host.watched_engines()) == MAX_ENGINES


# --- the whole path on a Ray cluster ---------------------------------------------------------


@pytest.fixture(scope="module")
def fabric(layout):
    from kvfabric.actors.launch import start, stop
    from kvfabric.actors.node.node_actor import NodeConfig
    from kvfabric.deploy.harness.cluster import local_cluster

    config = NodeConfig(layout, {p: PoolCapacity(16, 16) for p in layout.pools}, device="cpu")
    with local_cluster(2, cpus_per_node=2):
        f = start(config, shards=2, cpus_per_actor=0.25, watch_s=0.3)
        try:
            yield f
        finally:
            stop(f)


def publish_engine(fabric, name: str, tokens: list[int]):
    """Publish an engine's device cache holding `tokens` under `name`, as a new life."""
    from kvfabric.actors.epochs import GcsEpochs
    from kvfabric.deploy.vllm.events.engine_pages import EnginePages
    from kvfabric.deploy.vllm.events.index_sink import ShardSink

    from tests.deploy.vllm.events.test_engine_pages import GROUPS, LAYOUT, PS, Engine

    pages = EnginePages(name, GcsEpochs().claim(), LAYOUT, GROUPS)
    sink = ShardSink(fabric.directory)
    sink.attach(pages)
    pages.apply(
        Engine().compute(None, tuple(tokens), 0, len(tokens) // PS, list(range(len(GROUPS))))
    )
    sink.publish(every_shard=True)
    return pages


def holders(tokens: list[int]) -> set[str]:
    from kvfabric.actors.client import FabricClient
    from kvfabric.deploy.serving.cache_namespace import cache_namespace

    return {
        m.node for m in FabricClient.connect(timeout_s=10.0).lookup(tokens, cache_namespace(None))
    }


def test_a_killed_engine_leaves_the_index_and_its_next_life_stays(fabric):
    import ray

    node = sorted(fabric.nodes)[0]
    actor, name = fabric.nodes[node], f"{node}/engine/slot-0"
    tokens = list(range(1, 17))
    proc, staging = sleeper(), spec()
    try:
        first = publish_engine(fabric, name, tokens)
        ray.get(
            actor.engine_started.remote(
                EngineProcess(proc.pid, process_start(proc.pid), staging, name, first.epoch)
            ),
            timeout=T,
        )
        eventually(lambda: name in holders(tokens), "the engine's pages indexed")
        assert ray.get(actor.watched_engines.remote(), timeout=T) == [proc.pid]
        proc.kill()
        proc.wait(timeout=T)
        eventually(lambda: name not in holders(tokens), "the ended engine's entries cleared")
        # Retired, not only cleared: no shard keeps a slot for that life.
        eventually(
            lambda: all(name not in ray.get(s.holders.remote(), timeout=T) for s in fabric.shards),
            "the ended life's slot freed",
        )
        eventually(
            lambda: ray.get(actor.reap_engines.remote(), timeout=T) == {},
            "the node told it was retired",
        )
        # The same slot's next life publishes and stays through later passes.
        publish_engine(fabric, name, tokens)
        eventually(lambda: name in holders(tokens), "the next life indexed")
        ray.get(fabric.directory.reconcile.remote(add=False), timeout=T)
        assert name in holders(tokens)
    finally:
        proc.kill()


def test_a_node_actor_refuses_an_engine_named_under_another_node(fabric):
    import ray

    a, b = sorted(fabric.nodes)
    with pytest.raises(ray.exceptions.RayTaskError, match="under"):
        ray.get(
            fabric.nodes[a].engine_started.remote(EngineProcess(1, 0, spec(), f"{b}/engine/x", 1)),
            timeout=T,
        )
    assert ray.get(fabric.nodes[a].watched_engines.remote(), timeout=T) == []


def test_a_nodes_engines_go_with_it(fabric):
    # An engine the index names under a node the directory does not list is a stray.
    import ray

    name, tokens = "kvf-node-ffffffffffff/engine/0", list(range(40, 56))
    publish_engine(fabric, name, tokens)
    eventually(lambda: name in holders(tokens), "the engine's pages indexed")
    ray.get(fabric.directory.reconcile.remote(add=False), timeout=T)
    eventually(
        lambda: name not in holders(tokens), "the engine of a node that is not a member dropped"
    )


def test_a_restarted_node_adopts_its_engines_and_reaps_the_ones_that_ended(fabric):
    """A node actor killed and restarted by Ray knows no engine; its engines' records
    beside their staging files tell it. One engine still runs: watched again. One ended
    while the node was down: its staging files and record go, and its index life is
    retired (a later life of its name would stay)."""
    import ray
    from kvfabric.actors.directory import NAMESPACE

    node = sorted(fabric.nodes)[-1]
    actor = fabric.nodes[node]
    fingerprint = ray.get(actor.layout.remote(), timeout=T).fingerprint.hex()
    alive, ended = sleeper(), sleeper()
    tokens = list(range(300, 316))
    procs, staged = [], []
    try:
        for proc, slot in ((alive, "alive"), (ended, "ended")):
            name = f"{node}/engine/{slot}-{uuid.uuid4().hex[:6]}"
            life = publish_engine(fabric, name, tokens)
            s = spec()
            staged.append(StagingPages(s, ray.get(actor.layout.remote(), timeout=T)))
            announced = EngineProcess(
                proc.pid, process_start(proc.pid), s, name, life.epoch, node, fingerprint
            )
            announced.write_record()
            ray.get(actor.engine_started.remote(announced), timeout=T)
            procs.append(announced)
        eventually(lambda: {p.index_name for p in procs} <= holders(tokens), "both indexed")
        epoch = ray.get(actor.stats.remote(), timeout=T)["epoch"]
        ray.kill(actor, no_restart=False)
        ended.kill()  # while its node is down: no one watches it
        ended.wait(timeout=T)
        restarted = ray.get_actor(node, namespace=NAMESPACE)

        def new_life() -> bool:
            try:
                return ray.get(restarted.stats.remote(), timeout=T)["epoch"] > epoch
            except ray.exceptions.RayError:
                return False  # not back yet

        eventually(new_life, "the node actor restarted")
        eventually(
            lambda: ray.get(restarted.watched_engines.remote(), timeout=T) == [alive.pid],
            "the running engine watched again, the ended one reaped",
        )
        gone = procs[1]
        assert not gone.record_path().exists() and procs[0].record_path().exists()
        assert not any(gone.staging.path(p).exists() for p in LAYOUT_POOLS(fabric, restarted))
        eventually(lambda: gone.index_name not in holders(tokens), "the ended life retired")
        assert procs[0].index_name in holders(tokens)
    finally:
        for proc in (alive, ended):
            proc.kill()
        for p in procs:
            p.record_path().unlink(missing_ok=True)
        for pages in staged:
            pages.unlink()


def LAYOUT_POOLS(fabric, actor) -> tuple:
    import ray

    return ray.get(actor.layout.remote(), timeout=T).pools


def test_records_that_do_not_check_are_ignored(tmp_path, monkeypatch, layout):
    """A record a starting node reads is validated as an announcement is: another node's
    or fabric's is not adopted, a malformed one is skipped, never trusted."""
    import json

    from kvfabric.transport import staging

    monkeypatch.setattr(staging, "SHM_DIR", tmp_path)
    fp = layout.fingerprint.hex()
    good = EngineProcess(os.getpid(), process_start(os.getpid()), spec(), "", 0, NODE_NAME, fp)
    good.write_record()
    EngineProcess(1, 0, spec(), "", 0, "kvf-node-ffffffffffff", fp).write_record()
    EngineProcess(2, 0, spec(), "", 0, NODE_NAME, "00" * 16).write_record()
    for i, bad in enumerate(["not json", json.dumps([1]), json.dumps({"pid": 1}), "x" * 5000]):
        (tmp_path / f"kvf-bad-{i}.engine").write_text(bad)
    forged = {**json.loads(good.record_path().read_text()), "index_name": "kvf-node-x/engine/a"}
    (tmp_path / "kvf-forged.engine").write_text(json.dumps(forged))
    assert EngineProcess.read_records(NODE_NAME, fp) == [good]
    host = engine_host(layout)
    assert host.watched_engines() == [] and host.adopt_engines() == [os.getpid()]


def test_other_nodes_ended_engines_lose_their_staging_files_not_their_records(
    tmp_path, monkeypatch, layout
):
    """A starting node unlinks the staging files of engines of other nodes or fabrics on its
    host whose process ended (their node may never start again); a running one's files,
    and every record, stay (a record's own node retires its engine's index life)."""
    from kvfabric.transport import staging

    monkeypatch.setattr(staging, "SHM_DIR", tmp_path)
    fp = layout.fingerprint.hex()
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    gone = int(done.stdout)  # a process that ended (were its pid reused, the start differs)
    live = sleeper()
    try:
        procs = {
            "ended, another node": EngineProcess(
                gone, 1, spec(), "", 0, "kvf-node-ffffffffffff", fp
            ),
            "ended, another fabric": EngineProcess(gone, 1, spec(), "", 0, NODE_NAME, "00" * 16),
            "running, another node": EngineProcess(
                live.pid, process_start(live.pid), spec(), "", 0, "kvf-node-eeeeeeeeeeee", fp
            ),
        }
        for proc in procs.values():
            proc.write_record()
            for pool in PoolName:
                proc.staging.path(pool).write_bytes(b"x")
        host = engine_host(layout)
        assert host.adopt_engines() == []
        for what, proc in procs.items():
            left = [proc.staging.path(pool).exists() for pool in PoolName]
            assert left == [what.startswith("running")] * len(left), what
            assert proc.record_path().exists(), what
    finally:
        live.kill()
        live.wait(timeout=T)
