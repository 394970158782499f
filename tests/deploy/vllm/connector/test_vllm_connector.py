"""vLLM (CPU backend) with the FabricConnector, for real: one Ray cluster of two nodes
with the fabric on it (a node actor on each, the index, the directory), one engine for
the module (an engine starts in 25-90 s here), that of the head node's actor. The other
node is the remote one: a prefix only it holds is fetched over NIXL for the engine.

The engine's own KV cache is sized below the workload (3k tokens), so filler prompts
evict a conversation from it and the next turn is served from the node's host tier.
Reference outputs come from the same engine with a fresh cache_salt per run: no cache,
vLLM's or the fabric's, can match a salt never seen before, so every token is computed.
The engine and what the tests do with it: tests/deploy/vllm/connector/connector_engine.py.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

vllm = pytest.importorskip("vllm")

import ray  # noqa: E402
from kvfabric.actors.launch import start, stop
from kvfabric.actors.node.node_actor import NodeConfig  # noqa: E402
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.deploy.chaos.faults import ChaosAction, Fault, FaultKind  # noqa: E402
from kvfabric.deploy.serving.cache_namespace import cache_namespace  # noqa: E402

from tests.deploy.vllm.connector.connector_engine import (  # noqa: E402
    BLOCK,
    CALL_TIMEOUT_S,
    MAX_TOKENS,
    PROMPT_CHARS,
    eventually,
    running_engine,
)
from tests.waiting import stop_process  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(str(tmp_path_factory.mktemp("faults") / "faults.json")) as running:
        yield running


def test_greedy_outputs_are_deterministic(engine):
    prompt = engine.text()
    first = engine.reference(prompt)
    assert first == engine.reference(prompt)
    assert len(set(first)) > 1 or len(first) < MAX_TOKENS  # real weights, not one repeated token


def test_host_tier_hit_after_device_eviction_equals_uncached(engine):
    prompt = engine.text()
    want = engine.reference(prompt)
    assert engine.generate(prompt)[0] == want  # computed, then saved to the node
    engine.evict()
    before, host_before = engine.external_hits(), engine.node_host_hits()
    counted = engine.metric("vllm:kvfabric_loaded_tokens")
    counted_host = engine.metric("vllm:kvfabric_loaded_tokens", tier="host")
    got, cached = engine.generate(prompt)
    loaded = engine.external_hits() - before
    assert got == want
    # The whole pages of the prompt but its last token came from the fabric, some of
    # them loaded back from the node's host tier.
    assert loaded >= (PROMPT_CHARS - 1) // BLOCK * BLOCK - BLOCK, (loaded, cached)
    assert engine.node_host_hits() > host_before
    # The connector's own metrics, in vLLM's registry, say the same, by tier.
    assert engine.metric("vllm:kvfabric_loaded_tokens") - counted == loaded
    assert engine.metric("vllm:kvfabric_loaded_tokens", tier="host") > counted_host
    assert engine.metric("vllm:kvfabric_lookups") > 0


def test_conversation_longer_than_the_window(engine):
    """Turn 2 extends turn 1 (prompt and output): the hit covers more than the SWA window,
    and SWA KV is loaded for the window before its end only."""
    turn1 = engine.text(700)
    out1, _ = engine.generate(turn1)
    engine.saved(turn1)
    tok = engine.llm.get_tokenizer()
    turn2 = turn1 + tok.decode(out1) + engine.text(500)
    want = engine.reference(turn2)
    engine.evict()
    before, counted = engine.external_hits(), engine.counters()
    assert engine.generate(turn2)[0] == want
    assert engine.external_hits() - before >= 600, engine.what_happened(counted, turn2)


def test_a_repeat_vllm_holds_whole_is_not_saved_again(engine):
    """A repeat whose whole prompt vLLM's own cache holds asks the node nothing, and it
    is not saved again: the node took every page of it from the first run, as the
    connector saw (known_pages.py, by vLLM's block hashes of the real engine). Of the
    repeat and a new prompt after it, only the new prompt's save is counted."""
    from vllm import SamplingParams

    prompt, salt = engine.text(), f"repeat-{uuid.uuid4().hex}"
    want = engine.reference(prompt)

    def saves() -> int:
        return engine.metric("vllm:kvfabric_saved_requests")

    def step() -> None:
        """A step of the engine that saves nothing (a prompt shorter than a page)."""
        item = {"prompt": "step " * (BLOCK // 8), "cache_salt": f"step-{uuid.uuid4().hex}"}
        engine.llm.generate([item], SamplingParams(max_tokens=1), use_tqdm=False)

    def settled(text: str, salt: str, past: int) -> int:
        """The saves counted once the node holds `text`, the count has moved past
        `past`, and the engine has stepped on (a store is counted at a step)."""
        engine.saved(text, salt)
        eventually(lambda: saves() > past or step(), "a save counted")
        for _ in range(3):
            step()
        return saves()

    before = saves()
    assert engine.generate(prompt, salt)[0] == want
    first = settled(prompt, salt, before)
    got, cached = engine.generate(prompt, salt)
    assert got == want and cached >= (PROMPT_CHARS - 1) // BLOCK * BLOCK - BLOCK, cached
    other, other_salt = engine.text(), f"other-{uuid.uuid4().hex}"
    engine.generate(other, other_salt)
    assert settled(other, other_salt, first) == first + 1, engine.counters()


@pytest.mark.parametrize(
    "point,exception",
    [
        ("worker_load", "KeyError"),
        ("worker_load", "MemoryError"),
        ("worker_load", "InjectedFault"),
        ("node_load", "RuntimeError"),
        ("worker_save", "ValueError"),
        ("node_save", "OSError"),
    ],
)
def test_injected_failure_becomes_recomputation(engine, point, exception):
    prompt = engine.text()
    want = engine.reference(prompt)
    if point.endswith("save"):
        engine.arm(point, exception)
    assert engine.generate(prompt)[0] == want
    if point.endswith("load"):
        engine.saved(prompt)  # there is something to load
    engine.evict()
    if point.endswith("load"):
        engine.arm(point, exception)
    assert engine.generate(prompt)[0] == want
    assert point not in engine.armed(), "the fault never fired"
    # After the failure, the fabric still serves (a save that failed stored nothing,
    # so the next turn computes and saves again; a load that failed left the pages there).
    engine.evict()
    assert engine.generate(prompt)[0] == want


def test_a_node_stalled_past_the_deadline_costs_no_wait_and_keeps_its_slots_until_it_ends(
    engine,
):
    """The node actor stops (SIGSTOP) as the engine asks it for a load: the call's deadline
    (timeout_s, 5 s) passes, the request computes and equals uncached, nothing hangs. The
    call's staging slots stay out of use while the node may still write them, and come
    back once it resumed and the late call ended."""
    prompt = engine.text()
    want = engine.reference(prompt)
    assert engine.generate(prompt)[0] == want  # saved to the node
    engine.evict()
    pid = ray.get(engine.node.__ray_call__.remote(lambda self: os.getpid()), timeout=CALL_TIMEOUT_S)
    stop_process(pid)
    try:
        got = engine.generate(prompt)[0]
        assert engine.generate(engine.text(), salt="stalled")[0]  # another finished: a report
    finally:
        os.kill(pid, signal.SIGCONT)
    assert got == want

    def report() -> dict:
        engine.generate(engine.text(), salt=f"after-{uuid.uuid4().hex}")  # reports at its end
        (counters,) = ray.get(engine.node.engine_reports.remote(), timeout=CALL_TIMEOUT_S).values()
        return counters

    first = report()
    assert first["node_errors"] >= 1, first
    eventually(lambda: report()["quarantined_slots"] == 0, "the late call's slots came back")
    engine.evict()
    assert engine.generate(prompt)[0] == want  # the fabric serves again


def test_tenants_never_share(engine):
    prompt = engine.text()
    want = engine.reference(prompt)
    assert engine.generate(prompt, salt="tenant-a")[0] == want
    engine.evict()
    before = engine.external_hits()
    got, cached = engine.generate(prompt, salt="tenant-b")
    assert got == want and cached == 0
    assert engine.external_hits() == before
    engine.evict()
    got, cached = engine.generate(prompt, salt="tenant-a")
    assert got == want and engine.external_hits() > before


def test_a_fabric_of_another_layout_fails_the_start_naming_what_differs(engine):
    """A fabric running where the engine's identity would find its own, but caching
    another layout (here: another model's content), is never used: the connector's
    start fails, and the error names the part of the identity that differs."""
    from dataclasses import replace

    from kvfabric.actors.names import layout_namespace
    from kvfabric.deploy.vllm.connector.jobs import FabricSettings
    from kvfabric.deploy.vllm.connector.node_link import FabricUnavailable, NodeLink

    layout = engine.layout
    parts = layout.tag.split(";")
    other = replace(
        layout,
        tag=";".join(p if not p.startswith("model=") else "model=0123456789abcdef" for p in parts),
    )
    base = f"kvf-mismatch-{uuid.uuid4().hex[:6]}"
    caps = {p: PoolCapacity(device=4, host=4) for p in layout.pools}
    fab = start(
        NodeConfig(other, caps, device="cpu"),
        shards=1,
        timeout_s=CALL_TIMEOUT_S,
        watch_s=0,
        namespace=layout_namespace(layout.fingerprint, base),
    )
    try:
        link = NodeLink(
            FabricSettings(node_actor=engine.here, ray_namespace=base, timeout_s=CALL_TIMEOUT_S),
            layout,
        )
        with pytest.raises(FabricUnavailable, match="tag model: '[0-9a-f]+' vs '0123456789abcdef'"):
            link.start(CALL_TIMEOUT_S)
        assert not link.ready()
        same = NodeLink(FabricSettings(node_actor=engine.here, timeout_s=CALL_TIMEOUT_S), layout)
        same.start(CALL_TIMEOUT_S)  # the engine's own fabric: connects
        assert same.ready() and same.namespace == engine.namespace
    finally:
        stop(fab)


def test_remote_hit_from_another_node_equals_uncached(engine):
    """A prompt only the other node holds is fetched from it (NIXL, the node's fetch
    transaction) while the engine keeps stepping, then loaded: output equal to the
    uncached run, and the loaded tokens count as remote (p2p) hits."""
    prompt = engine.text()
    want = engine.reference(prompt)
    engine.move_to_peer(prompt)
    before, remote_before = engine.external_hits(), engine.remote_hits()
    fetched_before = ray.get(engine.node.stats.remote(), timeout=CALL_TIMEOUT_S)["fetches"].get(
        "committed", 0
    )
    got, _ = engine.generate(prompt)
    assert got == want
    assert (
        ray.get(engine.node.stats.remote(), timeout=CALL_TIMEOUT_S)["fetches"].get("committed", 0)
        == fetched_before + 1
    )
    loaded = engine.external_hits() - before
    assert (
        engine.remote_hits() - remote_before
        == loaded
        >= (PROMPT_CHARS - 1) // BLOCK * BLOCK - BLOCK
    )


@pytest.mark.parametrize("kind", list(FaultKind))
def test_transport_fault_on_a_remote_fetch_becomes_recomputation(engine, kind):
    """The engine's node fails its read from the peer (each fault kind; a delay past the
    fetch deadline): the fetch rolls back whole, the request computes, output equal."""
    prompt = engine.text()
    want = engine.reference(prompt)
    engine.move_to_peer(prompt)
    engine.quiet()
    fired, remote_before = (
        ray.get(engine.node.fired.remote(), timeout=CALL_TIMEOUT_S),
        engine.remote_hits(),
    )
    fault = Fault(kind, after=1, delay_s=8.0)  # DELAY: 4x the node's fetch deadline (2 s)
    ray.get(engine.node.inject.remote(ChaosAction(transport=fault)), timeout=CALL_TIMEOUT_S)
    try:
        assert engine.generate(prompt)[0] == want
        assert ray.get(engine.node.fired.remote(), timeout=CALL_TIMEOUT_S) == fired + 1, (
            "the fault never acted"
        )
        assert engine.remote_hits() == remote_before
    finally:
        engine.quiet()
    ray.get([engine.node.check.remote(), engine.peer.check.remote()], timeout=CALL_TIMEOUT_S)


def test_kv_events_name_the_engine_in_the_index_until_it_evicts(engine):
    """The engine's own device cache, fed to the fabric's index by its KV events: after a
    request the index names the engine for the prompt's pages (that tenant's only), and
    after the engine evicts them, or clears its cache, it no longer does."""
    from kvfabric.deploy.serving.engine_identity import engine_index_node
    from kvfabric.deploy.vllm.events.engine_pages import group_pools_of
    from kvfabric.deploy.vllm.events.index_sink import start_engine_feed
    from vllm import SamplingParams

    layout = engine.layout
    directory = engine.fabric.directory  # the module's fabric: its directory and shard
    pools = group_pools_of(
        engine.llm.llm_engine.engine_core.call_utility("get_kv_cache_group_metadata")
    )
    feed = start_engine_feed(
        directory,
        engine.here,
        "0",
        layout,
        pools,
        engine.events,
        engine.events + "-replay",
        namespace=engine.namespace,
    )
    me = engine_index_node(engine.here, "0")
    try:
        client = engine.client()

        def engine_pages(tokens: list[int], salt: str) -> int:
            return max(
                (m.pages for m in client.lookup(tokens, cache_namespace(salt)) if m.node == me),
                default=0,
            )

        def step_engine() -> None:
            # vLLM hands its KV events to the publisher in a step: a one-token request makes one.
            engine.generate("x", salt=f"step-{uuid.uuid4().hex}")

        def wait_until(cond, what: str, poke=lambda: time.sleep(0.1)) -> None:
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while not cond():
                assert time.monotonic() < deadline, (
                    f"timed out waiting until {what} ({feed.stats}, {feed.pages.stats})"
                )
                poke()

        def prompt_tokens(salt: str) -> list[int]:
            out = engine.llm.generate(
                [{"prompt": engine.text(), "cache_salt": salt}],
                SamplingParams(temperature=0, max_tokens=1),
                use_tqdm=False,
            )[0]
            return list(out.prompt_token_ids)

        salt = f"events-{uuid.uuid4().hex}"
        tokens = prompt_tokens(salt)
        wait_until(lambda: engine_pages(tokens, salt) > 0, "the index names the engine")
        assert engine_pages(tokens, f"other-{salt}") == 0  # another tenant's identical prompt
        engine.evict()
        wait_until(
            lambda: engine_pages(tokens, salt) == 0, "the evicted prompt is gone from the index"
        )

        tokens = prompt_tokens(salt)
        wait_until(lambda: engine_pages(tokens, salt) > 0, "the index names the engine again")

        # Blocks of a finished request wait for the connector's save, which completes in a
        # later step: a reset refused for that is tried again after a step.
        wait_until(engine.llm.reset_prefix_cache, "the engine clears its cache", poke=step_engine)
        wait_until(
            lambda: engine_pages(tokens, salt) == 0,
            "a cleared cache is gone from the index",
            poke=step_engine,
        )
        assert feed.stats.bad_frames == 0 and feed.pages.stats.clears > 0
    finally:
        assert feed.stop()
