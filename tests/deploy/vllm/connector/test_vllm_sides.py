"""The FabricConnector's scheduler and worker sides without an engine: real KV tensors in
vLLM's CPU layout, real staging files, a real NodeCache. Only the Ray hop to the node
actor is replaced (by direct calls of the same functions the actor runs).

Checks: block -> fabric -> block round trips are exact (full pages all, SWA the window);
a load vLLM asks for that the fabric cannot complete is reported failed; any exception
at any step becomes a failed load or a skipped save, never an escaped error, and no
staging slot leaks. The rig they run on: tests/deploy/vllm/connector/sides_rig.py."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
import uuid
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples

pytest.importorskip("vllm")

from kvfabric.core.cache.layout import PoolName
from kvfabric.deploy.chaos.faults import StepFaultFile  # noqa: E402
from kvfabric.deploy.vllm.connector.block_format import BlockFormat  # noqa: E402
from kvfabric.deploy.vllm.connector.jobs import FabricSettings  # noqa: E402
from kvfabric.deploy.vllm.connector.scheduler_side import SchedulerSide  # noqa: E402
from kvfabric.deploy.vllm.connector.worker_side import WorkerSide  # noqa: E402
from kvfabric.transport.staging import StagingSpec  # noqa: E402

from tests.deploy.vllm.connector.sides_rig import (  # noqa: E402
    FULL_BLOCKS,
    NAMES,
    NB,
    PLAN,
    PROMPT,
    PS,
    SWA_BLOCKS,
    Blocks,
    D,
    H,
    LocalNode,
    Req,
    Rig,
    finish_first,
    hashes,
)

EXCEPTIONS = ["ValueError", "KeyError", "RuntimeError", "MemoryError", "OSError", "InjectedFault"]


@contextlib.contextmanager
def rigged(tmp_path, hash_block_size: int | None = None):
    spec = StagingSpec(f"kvf-test-{uuid.uuid4().hex[:8]}", 64)
    fault_file = str(tmp_path / "faults.json")
    settings_ = FabricSettings(node_actor="local", **StepFaultFile.settings(fault_file))
    sched = SchedulerSide(PLAN, settings_, spec, hash_block_size=hash_block_size)
    node = LocalNode(spec)
    node.attach(sched)
    worker = WorkerSide(PLAN, settings_, spec)
    g = torch.Generator().manual_seed(0)
    kv = {n: torch.randn(NB, H, PS, 2 * D, generator=g) for n in NAMES}
    worker.register(kv, BlockFormat.KV_ROWS)
    try:
        yield Rig(sched, worker, kv, fault_file, node)
    finally:
        node.shared.unlink()


@pytest.fixture
def rig(tmp_path):
    with rigged(tmp_path) as r:
        yield r


def admit(rig: Rig, rid: str, swa_blocks: list[int]) -> tuple[int, object]:
    req = Req(rid, PROMPT, PROMPT, 0)
    n, is_async = rig.sched.num_new_matched_tokens(req, 0)
    if n:
        assert is_async
        rig.sched.after_alloc(req, Blocks((swa_blocks, list(range(30, 41)))), n)
    return n, rig.step()


def layer_blocks(rig: Rig, name: str, blocks: list[int]) -> torch.Tensor:
    return rig.kv[name][blocks]


def test_blocks_round_trip_through_the_fabric(rig):
    finish_first(rig)
    n, out = admit(rig, "r2", [0] * 8 + [40, 41, 42])
    assert n == 40 and out.finished_recving == {"r2"} and not out.failed_recving
    for name in NAMES[1::2]:  # full layers: every page
        assert torch.equal(
            layer_blocks(rig, name, list(range(30, 40))), layer_blocks(rig, name, FULL_BLOCKS[:10])
        )
    for name in NAMES[0::2]:  # SWA layers: the window before the hit's end
        assert torch.equal(layer_blocks(rig, name, [40, 41]), layer_blocks(rig, name, [20, 21]))
    assert all(a.free_count == a.capacity for a in rig.sched.slots.allocators.values())
    # The node keeps what the connector counted, as of the last finished request: it
    # hears once a step, after the step's requests finished (vLLM then asks for stats).
    rig.sched.finished(Req("r2", PROMPT, PROMPT + [7], len(PROMPT)), (SWA_BLOCKS, FULL_BLOCKS))
    assert not rig.node.reports
    rig.sched.send_report()
    (report,) = rig.node.reports.values()
    assert report["finished_requests"] == 2 and report["loaded_tokens"] == 40
    assert report["host_loaded_tokens"] + report["remote_loaded_tokens"] <= 40


def test_load_vllm_wants_beyond_the_window_is_reported_failed(rig):
    finish_first(rig)
    n, out = admit(rig, "r2", [0] * 5 + [43, 44, 45, 40, 41, 42])
    assert n == 40 and out.failed_recving == {"r2"}
    stats = rig.sched.stats  # a failed load is a failure, not a hit
    assert stats.load_failures == 1 and stats.loaded_tokens == stats.host_loaded_tokens == 0
    # vLLM recomputes it; the connector does not offer it again.
    assert rig.sched.num_new_matched_tokens(Req("r2", PROMPT, PROMPT, 0), 0) == (0, False)


def test_asked_again_while_waiting_the_staged_answer_stands(rig):
    """vLLM asks again at each step a request waits for room: the same own hit gets the
    same answer with no call to the node (a call would block the engine's loop); a
    different own hit is planned anew, and a request whose node held nothing more is
    not asked about again."""
    finish_first(rig)
    calls = []
    node_call = rig.node.call
    rig.node.call = lambda method, *args: calls.append(method) or node_call(method, *args)
    req = Req("r2", PROMPT, PROMPT, 0)
    assert rig.sched.num_new_matched_tokens(req, 0) == (40, True)
    assert rig.sched.num_new_matched_tokens(req, 0) == (40, True)
    assert calls == ["load_staged"]
    held = sum(a.capacity - a.free_count for a in rig.sched.slots.allocators.values())
    assert rig.sched.num_new_matched_tokens(req, 8) == (32, True)  # vLLM's own hit grew
    assert calls == ["load_staged"] * 2
    assert sum(a.capacity - a.free_count for a in rig.sched.slots.allocators.values()) <= held
    rig.sched.after_alloc(req, Blocks(([0] * 8 + [40, 41, 42], list(range(30, 41)))), 32)
    out = rig.step()
    assert out.finished_recving == {"r2"} and not out.failed_recving
    assert all(a.free_count == a.capacity for a in rig.sched.slots.allocators.values())
    # Another prompt the node holds none of: asked once, then answered from memory.
    other = Req("r3", list(range(500, 541)), list(range(500, 541)), 0)
    assert rig.sched.num_new_matched_tokens(other, 0) == (0, False)
    assert rig.sched.num_new_matched_tokens(other, 0) == (0, False)
    assert calls == ["load_staged"] * 3


def test_a_next_turn_saves_only_its_new_full_pages(rig):
    """A conversation's next turn copies the full KV the node does not hold yet (plus the
    SWA window), not the whole conversation again; what the node then holds loads back
    equal to the engine's blocks."""
    finish_first(rig)  # the node holds PROMPT's 10 pages
    n, out = admit(rig, "r2", [0] * 8 + [40, 41, 42])  # loaded into full blocks 30..39
    assert n == 40 and out.finished_recving == {"r2"}
    turn = PROMPT + [7, 8, 9, 10, 11, 12, 13]  # 48 tokens: 12 pages
    delay, _ = rig.sched.finished(
        Req("r2", PROMPT, turn, len(turn)), ([0] * 10 + [44, 45], list(range(30, 42)))
    )
    (job,) = rig.sched.saves.jobs
    moved = {m.pool: len(m.slots) for m in job.moves}
    assert delay and moved == {PoolName.FULL: 2, PoolName.SWA: 2}
    rig.step()
    assert rig.sched.stats.stored_pages == 10 + 2
    # The whole turn loads back: its new full pages from blocks 40 and 41.
    req = Req("r3", turn + [99], turn + [99], 0)
    n, _ = rig.sched.num_new_matched_tokens(req, 0)
    assert n == 48
    rig.sched.after_alloc(req, Blocks(([0] * 10 + [50, 51], list(range(50, 62)))), n)
    out = rig.step()
    assert out.finished_recving == {"r3"} and not out.failed_recving
    for name in NAMES[1::2]:
        assert torch.equal(
            layer_blocks(rig, name, list(range(50, 62))),
            layer_blocks(rig, name, list(range(30, 42))),
        )
    for name in NAMES[0::2]:
        assert torch.equal(layer_blocks(rig, name, [50, 51]), layer_blocks(rig, name, [44, 45]))
    assert all(a.free_count == a.capacity for a in rig.sched.slots.allocators.values())


def test_a_prompt_vllm_holds_whole_copies_only_what_the_node_did_not_take(tmp_path):
    """A repeat whose whole prompt vLLM's own cache holds asks the node nothing, and its
    save copies no page this engine saw the node store or load (known_pages.py); a
    prompt the node never took, an engine whose hashes do not name pages, and one whose
    node failed a call copy every page as before."""

    def repeat(rig: Rig, rid: str, prompt: list[int]) -> int:
        """vLLM's own hit for all but the last token, then the request's end: the
        pages its save copies (its prompt's save and its end's)."""
        tokens = prompt + [7, 8, 9]
        req = Req(rid, prompt, tokens, len(prompt) + 2, block_hashes=hashes(tokens))
        calls, node_call = [], rig.node.call
        rig.node.call = lambda method, *args: calls.append(method) or node_call(method, *args)
        assert rig.sched.num_new_matched_tokens(req, len(prompt) - 1) == (0, False)
        rig.node.call = node_call
        assert calls == []  # the node was not asked
        rig.sched.finished(req, (SWA_BLOCKS, FULL_BLOCKS))
        copied = sum(len(m.slots) for job in rig.sched.saves.jobs for m in job.moves)
        rig.step()
        return copied

    with rigged(tmp_path, hash_block_size=PS) as rig:
        first = Req("r1", PROMPT, PROMPT + [7, 8, 9], len(PROMPT) + 2)
        first.block_hashes = hashes(first.all_token_ids)
        assert rig.sched.finished(first, (SWA_BLOCKS, FULL_BLOCKS))[0]
        rig.step()
        assert rig.sched.stats.stored_pages == 10 and len(rig.sched.known) == 10
        assert repeat(rig, "r2", PROMPT) == 0
        assert rig.sched.stats.saved_requests == 1  # nothing more stored: nothing was sent
        other = list(range(500, 541))
        assert repeat(rig, "r3", other) > 0  # never stored: every page copied
        assert repeat(rig, "r4", other) == 0  # stored by r3 now
        # A node that failed a call may have lost what it held: known no longer.
        rig.sched._load_failed("r5", {}, None, RuntimeError("node gone"))
        assert len(rig.sched.known) == 0 and repeat(rig, "r6", PROMPT) > 0
    with rigged(tmp_path) as rig:  # vLLM's hashes not known to end on pages
        finish_first(rig)
        assert repeat(rig, "r2", PROMPT) > 0


def test_a_fabric_hit_teaches_what_the_node_holds(tmp_path):
    """Pages loaded through the node are known held: a later repeat vLLM's own cache
    holds whole copies none of them."""
    with rigged(tmp_path, hash_block_size=PS) as rig:
        finish_first(rig)  # stored without hashes: not known
        req = Req("r2", PROMPT, PROMPT, 0, block_hashes=hashes(PROMPT))
        n, _ = rig.sched.num_new_matched_tokens(req, 0)
        assert n == 40
        rig.sched.after_alloc(req, Blocks(([0] * 8 + [40, 41, 42], list(range(30, 41)))), n)
        out = rig.step()
        assert out.finished_recving == {"r2"} and not out.failed_recving
        assert len(rig.sched.known) == 10


def test_tenants_do_not_share(rig):
    finish_first(rig)
    req = Req("r2", PROMPT, PROMPT, 0, cache_salt="other")
    assert rig.sched.num_new_matched_tokens(req, 0) == (0, False)


@settings(max_examples=examples(30), deadline=None)
@given(
    point=st.sampled_from(["node_load", "worker_load", "worker_save", "node_save"]),
    exception=st.sampled_from(EXCEPTIONS),
)
def test_any_failure_becomes_recomputation(tmp_path_factory, point, exception):
    spec = StagingSpec(f"kvf-test-{uuid.uuid4().hex[:8]}", 64)
    settings_ = FabricSettings(
        node_actor="local",
        **StepFaultFile.settings(str(tmp_path_factory.mktemp("f") / "faults.json")),
    )
    node = LocalNode(spec)
    try:
        sched, worker = SchedulerSide(PLAN, settings_, spec), WorkerSide(PLAN, settings_, spec)
        node.attach(sched)
        worker.register({n: torch.randn(NB, H, PS, 2 * D) for n in NAMES}, BlockFormat.KV_ROWS)
        rig = Rig(sched, worker, worker.views, settings_.step_hook_arg, node)
        if point.endswith("save"):
            rig.arm(point, exception)
        finish_first(rig)
        if point.endswith("load"):
            rig.arm(point, exception)
        n, out = admit(rig, "r2", [0] * 8 + [40, 41, 42])
        if point.endswith("save"):
            assert n == 0  # nothing was stored
        elif point == "node_load":
            assert n == 0 and sched.stats.node_errors == 1
        else:
            assert n == 40 and out.failed_recving == {"r2"}
        with open(settings_.step_hook_arg) as f:
            assert point not in json.load(f)  # the fault fired
        held = sum(len(s) for _, q in sched.slots.quarantined for s in q.values())
        assert sum(a.capacity - a.free_count for a in sched.slots.allocators.values()) == held
        node.cache.check()
    finally:
        node.shared.unlink()


def test_an_engine_whose_staging_does_not_fit_fails_its_start_and_leaves_no_file(tmp_path):
    """A full /dev/shm as a worker registers its KV caches: the start fails (vLLM ends the
    engine; Serve starts another) with the space error, and no staging file is made."""
    from kvfabric.deploy.chaos.faults.step_file import FULL
    from kvfabric.transport.staging import StagingSpaceError

    spec = StagingSpec(f"kvf-test-{uuid.uuid4().hex[:8]}", 64)
    fault_file = tmp_path / "faults.json"
    fault_file.write_text(json.dumps({"staging": FULL}))
    worker = WorkerSide(
        PLAN, FabricSettings(node_actor="local", **StepFaultFile.settings(str(fault_file))), spec
    )
    kv = {n: torch.randn(NB, H, PS, 2 * D) for n in NAMES}
    with pytest.raises(StagingSpaceError):
        worker.register(kv, BlockFormat.KV_ROWS)
    assert worker.shared is None
    assert not any(spec.path(p).exists() for p in PLAN.layout.pools)
    worker.register(kv, BlockFormat.KV_ROWS)  # the next start, with room, maps them
    try:
        assert all(spec.path(p).exists() for p in PLAN.layout.pools)
    finally:
        assert worker.shared is not None
        worker.shared.unlink()


def test_a_stopping_engine_takes_its_staging_files_along_though_its_worker_died(rig):
    """A worker killed (-9) never unlinks the staging files, and vLLM then stops the rest
    of the engine cleanly, record and all: the scheduler side's stop unlinks them."""
    paths = [rig.sched.spec.path(p) for p in PLAN.layout.pools]
    assert all(p.exists() for p in paths)
    rig.sched.shutdown()
    assert not any(p.exists() for p in paths)
    rig.sched.shutdown()  # again: nothing left, nothing raised


def held_slots(rig: Rig) -> set[tuple[PoolName, int]]:
    return {(pool, i) for pool, a in rig.sched.slots.allocators.items() for i in a.used_indices()}


def quarantined_slots(rig: Rig) -> set[tuple[PoolName, int]]:
    return {(p, i) for _, q in rig.sched.slots.quarantined for p, s in q.items() for i in s}


def test_slots_of_a_store_given_up_on_stay_out_of_use_until_the_late_call_ends(rig, monkeypatch):
    """A store past its deadline is given up (the engine never waits), and its slots stay
    out of use however much time passes, while the node may still read them; the late
    store then reads what the worker copied, and its slots come back."""
    quick = dataclasses.replace(rig.sched.settings, timeout_s=0.0)
    rig.sched.settings = rig.sched.saves.settings = quick
    rig.node.stalled = []
    finish_first(rig)
    rig.sched.saves.collect_stores()
    assert rig.sched.stats.save_failures == 1 and rig.sched.stats.saved_requests == 0
    assert not rig.sched.saves.storing
    held = quarantined_slots(rig)
    assert held and held_slots(rig) == held
    later = time.monotonic() + 86_400.0
    monkeypatch.setattr(time, "monotonic", lambda: later)  # a day on: no timer frees them
    rig.step()
    assert quarantined_slots(rig) == held_slots(rig) == held
    rig.node.resume()  # the late store runs: it reads intact slots
    rig.step()
    assert not rig.sched.slots.quarantined and not held_slots(rig)
    n, out = admit(rig, "r2", [0] * 8 + [40, 41, 42])
    assert n == 40 and out.finished_recving == {"r2"} and not out.failed_recving
    for name in NAMES[1::2]:
        assert torch.equal(
            layer_blocks(rig, name, list(range(30, 40))), layer_blocks(rig, name, FULL_BLOCKS[:10])
        )


def test_slots_of_a_load_given_up_on_are_not_handed_out_until_the_late_call_ends(rig, monkeypatch):
    """A load past its deadline: the request computes; the slots the node may still write
    go to no other request (r3's load stages elsewhere and arrives exact although r2's late
    load writes meanwhile), and come back once the late call has ended."""
    finish_first(rig)
    rig.node.stalled = []
    r2 = Req("r2", PROMPT, PROMPT, 0)
    assert rig.sched.num_new_matched_tokens(r2, 0) == (None, False)  # asked again next step
    assert rig.sched.stats.node_errors == 0
    later = time.monotonic() + 86_400.0
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert rig.sched.num_new_matched_tokens(r2, 0) == (0, False)  # past its deadline: computes
    assert rig.sched.stats.node_errors == 1
    held = quarantined_slots(rig)
    assert held and held_slots(rig) == held
    rig.step()
    assert quarantined_slots(rig) == held
    late, rig.node.stalled = rig.node.stalled, None
    req = Req("r3", PROMPT, PROMPT, 0)
    n, _ = rig.sched.num_new_matched_tokens(req, 0)
    assert n == 40
    assert not (held_slots(rig) - held) & held  # r3 staged in other slots
    rig.node.stalled = late
    rig.node.resume()  # r2's late load writes its own slots now
    rig.sched.after_alloc(req, Blocks(([0] * 8 + [40, 41, 42], list(range(30, 41)))), n)
    out = rig.step()
    assert out.finished_recving == {"r3"} and not out.failed_recving
    for name in NAMES[1::2]:
        assert torch.equal(
            layer_blocks(rig, name, list(range(30, 40))), layer_blocks(rig, name, FULL_BLOCKS[:10])
        )
    rig.step()
    assert not rig.sched.slots.quarantined and not held_slots(rig)


SETTING_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 1 << 25),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)


def test_admission_never_waits_a_load_out_and_an_abort_keeps_its_slots_until_it_ends(rig):
    """The node's copy into staging runs while the engine steps: admission answers None
    (ask again) until the call answered, then the load; a request that ends while its load
    is in flight gives its slots back only once the node's call has ended."""
    finish_first(rig)
    rig.node.stalled = []  # the node copies, slowly
    req = Req("r2", PROMPT, PROMPT, 0)
    for _ in range(3):  # engine steps go on meanwhile
        assert rig.sched.num_new_matched_tokens(req, 0) == (None, False)
    rig.node.resume()
    assert rig.sched.num_new_matched_tokens(req, 0) == (40, True)
    rig.sched.after_alloc(req, Blocks(([0] * 8 + [40, 41, 42], list(range(30, 41)))), 40)
    out = rig.step()
    assert out.finished_recving == {"r2"} and not out.failed_recving
    for name in NAMES[1::2]:
        assert torch.equal(
            layer_blocks(rig, name, list(range(30, 40))), layer_blocks(rig, name, FULL_BLOCKS[:10])
        )
    assert rig.sched.stats.node_errors == 0 and not held_slots(rig)
    # Aborted (vLLM finishes a waiting request) while its load is in flight.
    rig.node.stalled = []
    r3 = Req("r3", PROMPT, PROMPT, 0)
    assert rig.sched.num_new_matched_tokens(r3, 0) == (None, False)
    assert rig.sched.finished(r3, ([], [])) == (False, None)
    held = quarantined_slots(rig)
    assert held and held_slots(rig) == held
    rig.step()
    assert quarantined_slots(rig) == held  # the node may still write them
    rig.node.resume()
    rig.step()
    assert not held_slots(rig)


DISK_CHOICES = {
    "disk_write": ("write_through", "write_back"),
    "disk_sync": ("none", "pages", "all"),
    "disk_io": ("auto", "nixl", "posix"),
}


@settings(max_examples=examples(200), deadline=None)
@given(
    name=st.sampled_from(sorted(FabricSettings.__dataclass_fields__) + ["bogus"]),
    value=SETTING_VALUES,
)
def test_connector_settings_of_a_wrong_type_or_range_are_refused(name, value):
    """kv_connector_extra_config comes from a deployment's config: each setting has its type
    and range, and anything else is a ValueError naming it."""
    field = FabricSettings.__dataclass_fields__.get(name)
    kind = field.type if field is not None else None
    low = field.metadata.get("min", 1) if field is not None else 1
    want_ok = {
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "int": lambda v: type(v) is int and low <= v <= 1 << 24,
        "float": lambda v: type(v) in (int, float) and 0 <= v <= 3600,
    }.get(kind, lambda v: False)(value)
    if name in ("step_hook", "node_hooks") and want_ok:  # "module:name", or unset
        want_ok = value == "" or re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value) is not None
    if name in DISK_CHOICES and want_ok:
        want_ok = value in DISK_CHOICES[name]
    if name in ("disk_pages", "swa_disk_pages") and want_ok:  # alone: no folder to hold them
        want_ok = value == 0
    try:
        got = FabricSettings.from_extra({name: value})
    except ValueError as e:
        assert not want_ok and name in str(e)
        return
    assert want_ok and getattr(got, name) == value


@pytest.mark.parametrize(
    "spec", ["kvfabric.no_such_module:Hook", "kvfabric.deploy.chaos.faults:NoSuchHook"]
)
def test_a_step_hook_that_does_not_load_is_refused_naming_the_setting(spec):
    from kvfabric.deploy.vllm.connector import kv_transfer_config

    with pytest.raises(ValueError, match="step_hook"):
        FabricSettings(step_hook=spec).make_step_hook()
    with pytest.raises(ValueError, match="step_hook"):
        kv_transfer_config("node", step_hook=spec)  # refused before any engine starts
    assert FabricSettings().make_step_hook() is None  # production: no hook at all


def test_a_step_handing_out_a_block_a_prompts_save_reads_fences_the_forward(rig):
    """A prompt's save copies after the forward, beside the next steps. A step that hands
    one of its blocks to a request (vLLM freed it: a preemption, a sliding window, an
    abort) tells the worker to wait for the save before the forward; other steps do not,
    nor do ended requests' saves (vLLM keeps their blocks until they are reported)."""
    sched = rig.sched
    namespace = sched._namespace(Req("p", PROMPT, PROMPT, len(PROMPT)))
    blocks = (SWA_BLOCKS, FULL_BLOCKS)

    def out(new=(), cached=()):
        return SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(block_ids=ids) for ids in new],
            scheduled_cached_reqs=SimpleNamespace(new_block_ids=list(cached)),
        )

    assert sched.saves.save("p", "p/prompt", PROMPT, namespace, blocks, 10, ends_request=False)
    assert not sched.saves.overwrites(out(new=[([0, 0, 40], [41])], cached=[None, ([42], [43])]))
    assert sched.saves.overwrites(out(new=[([0, 40], [FULL_BLOCKS[3]])]))
    assert sched.saves.overwrites(out(cached=[None, ([SWA_BLOCKS[9]], [])]))  # page 9: saved
    rig.step()  # the worker copies it and reports it: nothing reads the blocks any more
    assert not sched.saves.overwrites(out(new=[([SWA_BLOCKS[9]], [FULL_BLOCKS[3]])]))
    assert sched.saves.save("e", "e/end", PROMPT, namespace, blocks, 10, ends_request=True)
    assert not sched.saves.overwrites(out(new=[([SWA_BLOCKS[9]], [FULL_BLOCKS[3]])]))
    rig.step()
