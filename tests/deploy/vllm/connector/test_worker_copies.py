"""The worker's copies run off the engine's step and are reported when done: a load's
request and a finished request's blocks wait for the report; a prompt's save ends
before the next step's forward may write the blocks it reads."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

pytest.importorskip("vllm")

from kvfabric.deploy.vllm.connector.block_format import BlockFormat  # noqa: E402
from kvfabric.deploy.vllm.connector.jobs import ConnectorStep, CopyJob, FabricMeta  # noqa: E402
from kvfabric.transport.staging import StagingSpec  # noqa: E402

from tests.deploy.vllm.connector.test_block_format import ORDERS, copy_job, worker  # noqa: E402

WAIT_S = 30.0


class Gate:
    """A step hook that holds the copies of one step until opened."""

    def __init__(self, step: ConnectorStep) -> None:
        self.step = step
        self.opened = threading.Event()
        self.entered = threading.Event()

    def __call__(self, step: ConnectorStep) -> None:
        if step == self.step:
            self.entered.set()
            assert self.opened.wait(WAIT_S), "the test never opened the gate"


@pytest.fixture
def pair():
    spec = StagingSpec(f"kvf-test-{uuid.uuid4().hex[:8]}", 8)
    saver, saved = worker(spec, BlockFormat.KV_ROWS, ORDERS[0], "cpu", 1)
    loader, loaded = worker(spec, BlockFormat.KV_ROWS, ORDERS[0], "cpu", 2)
    yield saver, saved, loader, loaded
    for side in (saver, loader):
        side.step_hook = None
        side.close()
    saver.shared.unlink()


def save_job(ends_request: bool) -> CopyJob:
    job = copy_job([3, 9, 4], [5, 1, 2])
    job.ends_request = ends_request
    return job


def test_a_load_overlaps_the_step_and_is_reported_when_copied(pair):
    saver, saved, loader, loaded = pair
    saver.save(FabricMeta(saves=[save_job(True)]))
    assert saver.wait(WAIT_S)
    gate = loader.step_hook = Gate(ConnectorStep.WORKER_LOAD)
    loader.start_load(FabricMeta(loads=[copy_job([12, 0, 7], [5, 1, 2])]))  # returns at once
    assert gate.entered.wait(WAIT_S)
    assert loader.transfer_results() == (set(), set(), set())  # the request keeps waiting
    gate.opened.set()
    assert loader.wait(WAIT_S)
    assert loader.transfer_results() == (set(), {"r"}, set())
    for name, kv in loaded.items():
        assert torch.equal(kv[[12, 0, 7]], saved[name][[3, 9, 4]]), name


def test_an_idle_step_reports_its_loads_at_once(pair):
    saver, _, loader, _ = pair
    saver.save(FabricMeta(saves=[save_job(True)]))
    assert saver.wait(WAIT_S)
    gate = loader.step_hook = Gate(ConnectorStep.WORKER_LOAD)
    threading.Timer(0.2, gate.opened.set).start()  # the copy is slow; no forward to overlap
    loader.start_load(FabricMeta(loads=[copy_job([12, 0, 7], [5, 1, 2])], idle=True))
    assert loader.transfer_results() == (set(), {"r"}, set())


def test_a_finished_requests_blocks_stay_vllms_until_the_save_is_copied(pair):
    saver, *_ = pair
    gate = saver.step_hook = Gate(ConnectorStep.WORKER_SAVE)
    saver.save(FabricMeta(saves=[save_job(True)]))
    saver.start_load(FabricMeta())  # the next step does not wait for it
    assert gate.entered.wait(WAIT_S)
    assert saver.transfer_results() == (set(), set(), set()) and saver.worker_meta() is None
    gate.opened.set()
    assert saver.wait(WAIT_S)
    assert saver.transfer_results() == ({"r"}, set(), set())
    assert saver.worker_meta().saved == {"k": 1}


def test_a_prompts_save_ends_before_the_next_forward(pair):
    saver, *_ = pair
    gate = saver.step_hook = Gate(ConnectorStep.WORKER_SAVE)
    saver.save(FabricMeta(saves=[save_job(False)]))
    assert gate.entered.wait(WAIT_S)
    threading.Timer(0.2, gate.opened.set).start()
    saver.before_forward(FabricMeta(fence=True))  # a block it reads is handed out: it ends
    meta = saver.worker_meta()
    assert meta is not None and meta.saved == {"k": 1}
    assert saver.transfer_results() == (set(), set(), set())  # the request still runs


def test_a_prompts_save_runs_on_through_a_step_that_hands_out_none_of_its_blocks(pair):
    saver, *_ = pair
    gate = saver.step_hook = Gate(ConnectorStep.WORKER_SAVE)
    saver.save(FabricMeta(saves=[save_job(False)]))
    assert gate.entered.wait(WAIT_S)
    saver.before_forward(FabricMeta())  # returns with the copy still held at the gate
    assert saver.worker_meta() is None
    gate.opened.set()
    assert saver.wait(WAIT_S)
    assert saver.worker_meta().saved == {"k": 1}


@pytest.mark.parametrize("error", [RuntimeError, KeyError, MemoryError])
def test_a_copy_that_raises_is_reported_failed_and_the_next_one_runs(pair, error):
    saver, _, loader, _ = pair

    def fail(step: ConnectorStep) -> None:
        if step in (ConnectorStep.WORKER_SAVE, ConnectorStep.WORKER_LOAD):
            raise error("injected")

    saver.step_hook = loader.step_hook = fail
    saver.save(FabricMeta(saves=[save_job(True)]))
    loader.start_load(FabricMeta(loads=[copy_job([12, 0, 7], [5, 1, 2])]))
    assert saver.wait(WAIT_S) and loader.wait(WAIT_S)
    assert saver.transfer_results() == ({"r"}, set(), set())  # the blocks go back to vLLM
    assert saver.worker_meta().failed == {"k"}
    assert loader.transfer_results() == (set(), {"r"}, {"r"})  # vLLM recomputes
    saver.step_hook = None
    saver.save(FabricMeta(saves=[save_job(True)]))
    assert saver.wait(WAIT_S) and saver.worker_meta().saved == {"k": 1}


def test_a_job_naming_rows_out_of_range_fails_whole_and_writes_nothing(pair):
    """Every layer's rows are checked before a byte moves (the copy queue's submit): a load
    naming a block past vLLM's, or a save a slot past staging (a bad plan), is reported
    failed and leaves every block and page as it was; the next job runs."""
    saver, _, loader, loaded = pair
    before = {name: kv.clone() for name, kv in loaded.items()}
    loader.start_load(FabricMeta(loads=[copy_job([12, 0, 10_000], [5, 1, 2])]))
    assert loader.wait(WAIT_S)
    assert loader.transfer_results() == (set(), {"r"}, {"r"})  # vLLM recomputes
    assert all(torch.equal(kv, before[name]) for name, kv in loaded.items())
    staged = {p: t.clone() for p, t in saver.shared.pools.items()}
    saver.save(FabricMeta(saves=[copy_job([3, 9, 4], [5, 1, 99])]))
    assert saver.wait(WAIT_S) and saver.worker_meta().failed == {"k"}
    assert all(torch.equal(t, staged[p]) for p, t in saver.shared.pools.items())
    saver.save(FabricMeta(saves=[save_job(True)]))
    assert saver.wait(WAIT_S) and saver.worker_meta().saved == {"k": 1}
