"""A vLLM engine killed with -9 mid-load and mid-save, for real: the engine runs in a
process of its own (engine_proc.py) with the FabricConnector, on a Ray cluster of two
nodes with the fabric on it, and its connector's step hook kills vLLM's worker process
at its copy from or to staging (vLLM then ends the engine core, where the scheduler side
runs: the process the node watches).

After each kill, within bounded time, the node actor has reaped the engine: its staging
files and record are gone from /dev/shm, it watches it no more, the index names it no
more (that life retired), no page is leaked or owned twice and no lease is open; the
node's cache passes check() and still holds what was stored before the kill."""

from __future__ import annotations

import glob
import json
import os
import selectors
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import ray  # noqa: E402
from kvfabric.actors.client import FabricClient
from kvfabric.actors.directory import node_actor_name  # noqa: E402
from kvfabric.actors.launch import stop
from kvfabric.deploy.vllm.serve.model import ensure_tiny_model  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from tests.deploy.vllm.connector.connector_engine import (  # noqa: E402
    CALL_TIMEOUT_S,
    PROMPT_CHARS,
    TENANT,
    engine_fabric,
)
from tests.waiting import eventually  # noqa: E402

ROOT = Path(__file__).resolve().parents[4]
START_S = 600.0  # an engine starts in 25-90 s here; far longer on a loaded machine


class EngineProc:
    """An engine process: asked prompts over stdin, answering over stdout."""

    def __init__(self, address: str, here: str, tmp: Path) -> None:
        self.fault_file = str(tmp / "faults.json")
        self.log = open(tmp / "engine.log", "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.deploy.vllm.connector.engine_proc",
                address,
                here,
                self.fault_file,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
        )
        self.engine_id = self._answer(START_S)["engine_id"]
        (path,) = glob.glob(f"/dev/shm/kvf-vllm-{self.engine_id}.engine")
        self.record = json.loads(Path(path).read_text())  # the engine core's pid, its names

    def ask(self, prompt: str, salt: str | None = None) -> dict:
        """The engine's answer: {"tokens", "cached"}, or {"error"} once it died (a process
        that already ended answers that too)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"prompt": prompt, "salt": salt}) + "\n")
            self.proc.stdin.flush()
            return self._answer(CALL_TIMEOUT_S)
        except (BrokenPipeError, EOFError) as e:
            return {"error": repr(e)}

    def arm(self, point: str, what: str) -> None:
        with open(self.fault_file, "w") as f:
            json.dump({point: what}, f)

    def fired(self, point: str) -> bool:
        with open(self.fault_file) as f:
            return point not in json.load(f)

    def files(self) -> list[str]:
        return glob.glob(f"/dev/shm/kvf-vllm-{self.engine_id}[-.]*")

    def core_alive(self) -> bool:
        try:
            os.kill(self.record["pid"], 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{self.record['pid']}/stat") as f:  # a zombie is dead too
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=60)
        self.log.close()

    def _answer(self, timeout_s: float) -> dict:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                raise TimeoutError(f"no answer from the engine in {timeout_s} s")
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError(f"the engine process ended (rc {self.proc.poll()})")
        return json.loads(line)


@dataclass
class Site:
    address: str
    here: str
    tmp: object  # pytest's tmp_path_factory
    engines: list[EngineProc] = field(default_factory=list)
    rng_seed: int = 0

    def engine(self) -> EngineProc:
        e = EngineProc(self.address, self.here, self.tmp.mktemp("engine"))
        self.engines.append(e)
        return e

    def text(self) -> str:
        self.rng_seed += 1
        import random

        rng = random.Random(self.rng_seed)
        return "".join(rng.choice("abcdefghijklmnop qrstuvwxyz.,") for _ in range(PROMPT_CHARS))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, namespace=f"kvf-kill-{uuid.uuid4().hex[:6]}")
    cluster.wait_for_nodes()
    site = Site(
        cluster.address, node_actor_name(ray.get_runtime_context().get_node_id()), tmp_path_factory
    )
    try:
        yield site
    finally:
        for e in site.engines:
            e.stop()
            for f in e.files():
                os.unlink(f)
        try:
            stop(engine_fabric(str(ensure_tiny_model())))
        except (AssertionError, ValueError):
            pass  # no engine got as far as starting the fabric
        ray.shutdown()
        cluster.shutdown()


def token_ids(text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    return list(tok(text)["input_ids"])


def assert_reaped(engine: EngineProc, held: list[list[int]]) -> None:
    """The node reaped the killed engine and kept what it stored (`held`: prompts' ids)."""
    eventually(lambda: not engine.core_alive(), "the engine core died", deadline_s=CALL_TIMEOUT_S)
    fab = engine_fabric(str(ensure_tiny_model()))
    node = fab.nodes[engine.record["node"]]
    pid = engine.record["pid"]
    eventually(
        lambda: (
            pid not in ray.get(node.watched_engines.remote(), timeout=CALL_TIMEOUT_S)
            and not engine.files()
        ),
        "the node reaped the engine (staging files and record gone)",
        deadline_s=CALL_TIMEOUT_S,
    )
    client = FabricClient.connect(timeout_s=CALL_TIMEOUT_S, namespace=fab.namespace)
    name = engine.record["index_name"]
    assert name, engine.record
    eventually(
        lambda: all(name not in {m.node for m in client.lookup(ids, TENANT)} for ids in held),
        "the index names the engine no more",
        deadline_s=CALL_TIMEOUT_S,
    )
    audit = ray.get(node.audit.remote(), timeout=CALL_TIMEOUT_S)
    assert audit["leaked"] == audit["double_owned"] == 0, audit
    eventually(
        lambda: ray.get(node.stats.remote(), timeout=CALL_TIMEOUT_S)["leases"] == 0,
        "no lease open",
        deadline_s=CALL_TIMEOUT_S,
    )
    ray.get(node.check.remote(), timeout=CALL_TIMEOUT_S)
    for ids in held:
        assert ray.get(node.match.remote(ids, TENANT), timeout=CALL_TIMEOUT_S) > 0


def stored(engine: EngineProc, ids: list[int]) -> None:
    """Wait until the engine's node holds `ids` (its saves are asynchronous)."""
    fab = engine_fabric(str(ensure_tiny_model()))
    node = fab.nodes[engine.record["node"]]
    eventually(
        lambda: ray.get(node.match.remote(ids, TENANT), timeout=CALL_TIMEOUT_S) > 0,
        "the prompt stored on the node",
        deadline_s=CALL_TIMEOUT_S,
    )


def test_an_engine_killed_mid_save_is_reaped(site):
    engine = site.engine()
    kept = site.text()
    assert "tokens" in engine.ask(kept)
    assert "tokens" in engine.ask(site.text(), salt=f"filler-{uuid.uuid4().hex}")
    stored(engine, token_ids(kept))  # whole before the kill
    fab = engine_fabric(str(ensure_tiny_model()))
    client = FabricClient.connect(timeout_s=CALL_TIMEOUT_S, namespace=fab.namespace)
    eventually(  # its own cache is in the index (its KV events): the kill must clear that
        lambda: (
            engine.record["index_name"] in {m.node for m in client.lookup(token_ids(kept), TENANT)}
        ),
        "the index names the engine",
        deadline_s=CALL_TIMEOUT_S,
    )
    engine.arm("worker_save", "SIGKILL")
    answer = engine.ask(site.text())  # its prompt is copied to staging as it is computed
    if "tokens" in answer:
        answer = engine.ask(site.text())
    assert "error" in answer and engine.fired("worker_save")
    assert_reaped(engine, [token_ids(kept)])


def test_an_engine_killed_mid_load_is_reaped(site):
    engine = site.engine()
    prompt = site.text()
    assert "tokens" in engine.ask(prompt)
    for _ in range(3):  # evict it from the engine's own cache
        assert "tokens" in engine.ask(site.text(), salt=f"filler-{uuid.uuid4().hex}")
    stored(engine, token_ids(prompt))
    engine.arm("worker_load", "SIGKILL")
    assert "error" in engine.ask(prompt)  # loaded from the node: killed as the worker copies
    assert engine.fired("worker_load")
    assert_reaped(engine, [token_ids(prompt)])
