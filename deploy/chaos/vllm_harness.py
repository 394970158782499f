"""The chaos harness on vLLM engines (`kvfabric chaos --engine vllm`): the Ray Serve LLM
app with the FabricConnector in every engine, requests through its OpenAI API, and,
besides the fabric's own faults, those of the vLLM path: a worker killed (-9) as it
copies a load from staging or a save to it (vLLM then ends its engine; Serve starts
another), a node actor killed with a load staged but unanswered, a node actor stopped
past the engines' call deadline. Every answer must equal the uncached one (a fresh
cache_salt, which nothing cached can match), and once the run is over no staging file
may outlive its engine (the nodes reap what crashed engines leave).

The vLLM faults are armed through the app's chaos file (LLMAppArgs.chaos_file: every
engine's connector reads it at each step) and the node actors' NodeChaos; a stall is a
SIGSTOP, so the nodes must run on this host (an embedded cluster)."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import time
import uuid
from dataclasses import dataclass

import ray
from kvfabric.actors.directory import CALL_TIMEOUT_S
from kvfabric.actors.node.engine_process import EngineProcess
from kvfabric.deploy.cli.cluster import Endpoint
from kvfabric.deploy.vllm.llm_ingress import RETRIES_HEADER
from kvfabric.transport import staging
from ray.exceptions import GetTimeoutError, RayError

from .faults import ChaosAction
from .faults.step_file import KILL
from .harness import ChaosHarness
from .plan import ChaosKind
from .workload import Workload

SALT = "chaos"  # the workload's cached requests' cache_salt; uncached ones get a fresh one
STALL_MARGIN_S = 1.0  # a stall lasts the engines' call deadline and this much more
_WORKER_STEP = {
    ChaosKind.WORKER_KILL_MID_LOAD: "worker_load",
    ChaosKind.WORKER_KILL_MID_SAVE: "worker_save",
}


@dataclass(frozen=True)
class Answer:
    """A vLLM completion as the workload compares it: by its tokens (vLLM gives no digest
    of its logits, nor says which node served)."""

    token_ids: list[int]
    logits_digest: str = ""
    node: str = ""
    retries: int = 0


class LLMClient:
    """A keep-alive client of the vLLM app's /v1/completions, one per workload thread."""

    def __init__(self, endpoint: Endpoint, timeout_s: float = 300.0) -> None:
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self.conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout_s)

    def reconnect(self) -> None:
        self.conn.close()
        self.conn = http.client.HTTPConnection(
            self.endpoint.host, self.endpoint.port, timeout=self.timeout_s
        )

    def complete(
        self, model: str, tokens: list[int], max_tokens: int, cache: bool, namespace: str
    ) -> Answer:
        """Greedy tokens; `cache` False: under a salt never used before."""
        body = {
            "model": model,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            "cache_salt": namespace if cache else f"uncached-{uuid.uuid4().hex}",
        }
        self.conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = self.conn.getresponse()
        data = json.loads(resp.read() or b"{}")
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data.get('error', data)}")
        try:
            ids = data["choices"][0]["token_ids"]
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"malformed answer: {e!r}") from None
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise ValueError(f"malformed token ids: {ids!r:.80}")
        retries = resp.getheader(RETRIES_HEADER, "0")
        if not retries.isdigit():
            raise ValueError(f"malformed {RETRIES_HEADER}: {retries!r:.40}")
        return Answer(ids, retries=int(retries))

    def close(self) -> None:
        self.conn.close()


class VllmChaosHarness(ChaosHarness):
    """ChaosHarness over the vLLM app (`chaos_file`: the app's LLMAppArgs.chaos_file;
    `call_timeout_s`: the engines' node call deadline, FabricSettings.timeout_s)."""

    engine = "vllm"

    def __init__(self, *args, chaos_file: str, call_timeout_s: float = 5.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chaos_file, self.call_timeout_s = chaos_file, call_timeout_s
        self.earlier = orphans()  # left by runs before this one: not this run's to count
        self.fire_wait_s = 30.0  # a load or save comes when a request reaches that step
        self.restart_wait_s = 900.0  # Serve replaces an engine whose worker died

    def _workload(self, threads: int) -> Workload:
        return Workload(
            self.endpoint,
            self.model,
            self.prompts,
            threads,
            connect=lambda: LLMClient(self.endpoint, timeout_s=300.0),
        )

    def _inject(self, kind: ChaosKind, rng: random.Random, work: Workload) -> bool:
        try:
            if kind in _WORKER_STEP:
                return self._kill_worker(_WORKER_STEP[kind])
            if kind is ChaosKind.NODE_KILL_MID_LOAD:
                return self._kill_node_mid_load(rng)
            if kind is ChaosKind.NODE_STALL:
                return self._stall_node(rng)
        except (RayError, GetTimeoutError, ProcessLookupError) as e:  # a node restarting
            self.log(f"  {kind.value} not injected: {e}")
            return False
        return super()._inject(kind, rng, work)

    # --- the vLLM path's faults -----------------------------------------------------------
    def _kill_worker(self, step: str) -> bool:
        """Arm a SIGKILL at `step` for whichever engine reaches it first; True once one did
        (the file no longer names it) and Serve has started another in its place (the
        next fault then finds the app whole), False (disarmed) if none did in time."""
        engines = _running_engines()
        self._write_chaos_file({step: KILL})
        deadline = time.monotonic() + self.fire_wait_s
        while step in self._read_chaos_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._write_chaos_file({})
        if step in self._read_chaos_file():
            return False
        deadline = time.monotonic() + self.restart_wait_s
        while time.monotonic() < deadline:
            now = _running_engines()
            if len(now) >= len(engines) and now != engines:
                return True
            time.sleep(1.0)
        self.log(f"  no engine replaced the one killed at {step} in {self.restart_wait_s} s")
        return True

    def _kill_node_mid_load(self, rng: random.Random) -> bool:
        """A node dies (-9) once its next load is staged, before it answers; True once its
        process changed (Ray restarted it)."""
        nodes = self._nodes()
        name = rng.choice(sorted(nodes))
        before = _pid(nodes[name])
        ray.get(nodes[name].inject.remote(ChaosAction(exit_after_get=True)), timeout=CALL_TIMEOUT_S)
        deadline = time.monotonic() + self.fire_wait_s
        while time.monotonic() < deadline:
            try:
                if _pid(nodes[name]) != before:
                    return True
            except RayError:
                pass  # restarting
            time.sleep(0.1)
        ray.get(nodes[name].calm.remote(), timeout=CALL_TIMEOUT_S)
        return False

    def _stall_node(self, rng: random.Random) -> bool:
        """Stop a node's process past the engines' call deadline, then let it go on."""
        nodes = self._nodes()
        name = rng.choice(sorted(nodes))
        pid = _pid(nodes[name])
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(self.call_timeout_s + STALL_MARGIN_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        return True

    def _write_chaos_file(self, armed: dict) -> None:
        tmp = f"{self.chaos_file}.harness"
        with open(tmp, "w") as f:
            json.dump(armed, f)
        os.replace(tmp, self.chaos_file)

    def _read_chaos_file(self) -> dict:
        try:
            with open(self.chaos_file) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}  # being replaced: read again

    # --- checks -----------------------------------------------------------------------------
    def _calm(self) -> None:
        self._write_chaos_file({})
        super()._calm()

    def _leaked_staging_files(self, wait_s: float = 120.0) -> int:
        """Staging files and records in /dev/shm of engines that are not running, once the
        nodes had `wait_s` to reap them (a node restarted by a fault reaps at its start)."""
        deadline = time.monotonic() + wait_s
        while True:
            leaked = orphans() - self.earlier
            if not leaked or time.monotonic() >= deadline:
                if leaked:
                    self.log(f"staging files no running engine owns: {sorted(leaked)[:8]}")
                return len(leaked)
            time.sleep(1.0)


def orphans() -> set[str]:
    """Staging files and records in /dev/shm of engines that are not running."""
    live = _running_engines()
    return {
        f.name
        for f in staging.SHM_DIR.glob("kvf-vllm-*")
        if not any(f.name.startswith(prefix) for prefix in live)
    }


def _running_engines() -> set[str]:
    """The staging prefixes of the engines running on this host (their records)."""
    return {p.staging.prefix for p in EngineProcess.records() if p.alive()}


def remove_orphans(keep: set[str]) -> None:
    """Unlink the staging files and records of engines that are not running, but `keep`:
    an app shut down with its nodes leaves its engines' records (no node reaps them)."""
    for name in orphans() - keep:
        (staging.SHM_DIR / name).unlink(missing_ok=True)


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=CALL_TIMEOUT_S)
