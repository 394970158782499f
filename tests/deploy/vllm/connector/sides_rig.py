"""The FabricConnector's two sides wired without an engine, for tests: real KV tensors in
vLLM's CPU layout, real staging files, a real NodeCache (LocalNode: what NodeLink reaches
over Ray, called in process), and a Rig that steps them as vLLM would. Used by
test_vllm_sides.py and, with the peer and index at the edge, fabric_edge.py. No test here."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.deploy.vllm.connector.plan import EnginePlan, LayerSlot
from kvfabric.deploy.vllm.connector.scheduler_side import SchedulerSide
from kvfabric.deploy.vllm.connector.worker_side import WorkerSide
from kvfabric.transport.staging import StagingPages, StagingSpec, load_to_staging, save_from_staging

PS, H, D, NB = 4, 2, 8, 64
LAYOUT = KVLayout(
    layers=("swa", "full", "swa", "full"),
    kv_heads=H,
    head_dim=D,
    page_size=PS,
    window=8,
    tag="vllm:test",
)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
# Group 0: the SWA layers, group 1: the full ones (vLLM's hybrid allocator).
PLAN = EnginePlan(
    LAYOUT,
    (
        LayerSlot(NAMES[0], 0, PoolName.SWA, 0),
        LayerSlot(NAMES[1], 1, PoolName.FULL, 0),
        LayerSlot(NAMES[2], 0, PoolName.SWA, 1),
        LayerSlot(NAMES[3], 1, PoolName.FULL, 1),
    ),
    (PoolName.SWA, PoolName.FULL),
)


class LocalNode:
    """What NodeLink reaches over Ray, called in process."""

    def __init__(self, spec: StagingSpec) -> None:
        self.cache = NodeCache(
            LAYOUT, {p: PoolCapacity(device=64, host=64) for p in LAYOUT.pools}, device="cpu"
        )
        self.shared = StagingPages(spec, LAYOUT)
        self.disabled = ""
        self.name = "local"
        self.record = None  # no engine record: nothing here restarts
        self.actor = None  # no Ray actor: nothing to tell
        self.reports: dict[str, dict] = {}  # the connector's counters, as the node keeps them
        self.stalled: list[Answer] | None = None  # while a list: calls wait there, unrun

    def report(self, engine: str, stats) -> None:
        self.reports[engine] = dataclasses.asdict(stats)

    def ready(self) -> bool:
        return True

    def index_ready(self) -> bool:
        return False  # no fabric index: hits come from this node only

    def attach(self, sched: SchedulerSide) -> None:
        sched.node = sched.remote.link = sched.saves.node = self

    def call(self, method: str, *args):
        if method == "match":  # (tokens, namespace)
            return self.cache.match(*args).usable_pages
        fn = {"load_staged": load_to_staging, "save_staged": save_from_staging}[method]
        return fn(self.cache, self.shared, *args[1:])  # args[0]: the staging spec

    def submit(self, method: str, *args) -> "Answer":
        """A call that has answered by the time anyone asks, or, while the node is stalled,
        one that runs (late: after the engine gave up on it) at `resume`."""
        call = Answer(None, None, (method, args))
        if self.stalled is None:
            self._run(call)
        else:
            self.stalled.append(call)
        return call

    def resume(self) -> None:
        """Run the calls a stalled node held, in order, and stop stalling."""
        calls, self.stalled = self.stalled or [], None
        for call in calls:
            self._run(call)

    def _run(self, call: "Answer") -> None:
        try:
            call.value = self.call(*call.what[:1], *call.what[1])
        except Exception as e:
            call.error = e
        call.what = None

    def answer(self, call: "Answer"):
        if call.what is not None:
            raise TimeoutError("the node did not answer in time")
        return self.result(call)

    def finished(self, calls: list) -> list:
        return [c for c in calls if c.what is None]

    def wait_any(self, calls: list, timeout_s: float) -> int:
        """In process, a call has run by now or waits for `resume`: nothing to wait for."""
        return len(self.finished(calls))

    def result(self, call: "Answer"):
        if call.error is not None:
            raise call.error
        return call.value


@dataclass(eq=False)
class Answer:
    value: object
    error: BaseException | None
    what: tuple | None = None  # (method, args) until it has run


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None = None
    block_hashes: list = field(default_factory=list)  # vLLM's, where a test gives them


def hashes(tokens: list[int]) -> list[tuple[int, ...]]:
    """Block hashes as vLLM's chain them, one a whole page: each names its whole prefix."""
    return [tuple(tokens[: (i + 1) * PS]) for i in range(len(tokens) // PS)]


@dataclass
class Blocks:
    ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


@dataclass
class Rig:
    sched: SchedulerSide
    worker: WorkerSide
    kv: dict[str, torch.Tensor]
    fault_file: str
    node: LocalNode
    log: list = field(default_factory=list)

    def step(self):
        meta = self.sched.build_meta(
            SimpleNamespace(
                scheduled_new_reqs=[],
                num_scheduled_tokens={},
                total_num_scheduled_tokens=0,
                scheduled_cached_reqs=SimpleNamespace(
                    req_ids=[], num_computed_tokens=[], new_block_ids=[]
                ),
            )
        )
        self.worker.before_forward(meta)  # in vLLM's order: the forward comes between these
        self.worker.start_load(meta)
        self.worker.save(meta)
        assert self.worker.wait(30)  # vLLM steps until the copies are reported: here, one step
        sending, recving, failed = self.worker.transfer_results()
        out = SimpleNamespace(
            finished_sending=sending,
            finished_recving=recving,
            failed_recving=failed,
            kv_connector_worker_meta=self.worker.worker_meta(),
        )
        self.sched.on_output(out)
        self.sched.saves.collect_stores()  # what the next step's build_meta does first
        return out

    def arm(self, point: str, exception: str) -> None:
        with open(self.fault_file, "w") as f:
            json.dump({point: exception}, f)


PROMPT = list(range(100, 141))  # 41 tokens: 10 whole pages + 1
FULL_BLOCKS = list(range(1, 12))
SWA_BLOCKS = [0] * 8 + [20, 21, 22]  # vLLM's null block 0 before the window


def finish_first(rig: Rig) -> None:
    req = Req("r1", PROMPT, PROMPT + [7, 8, 9], len(PROMPT) + 2)
    delay, _ = rig.sched.finished(req, (SWA_BLOCKS, FULL_BLOCKS))
    assert delay
    out = rig.step()
    assert out.finished_sending == {"r1"}
