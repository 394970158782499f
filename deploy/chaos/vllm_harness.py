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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import ray
from kvfabric.actors.directory import CALL_TIMEOUT_S
from kvfabric.actors.node.engine_process import EngineProcess
from kvfabric.deploy.harness.cluster import Endpoint
from kvfabric.deploy.vllm.connector.jobs import ConnectorStep
from kvfabric.deploy.vllm.serve.llm_ingress import RETRIES_HEADER
from kvfabric.transport import staging
from ray.exceptions import GetTimeoutError, RayError

from .faults import ChaosAction, StepFaultFile
from .faults.step_file import FULL, KILL
from .harness import ChaosHarness
from .plan import ChaosKind
from .workload import NAMESPACE, Workload

STALL_MARGIN_S = 1.0  # a stall lasts the engines' call deadline and this much more
_WORKER_STEP = {
    ChaosKind.WORKER_KILL_MID_LOAD: "worker_load",
    ChaosKind.WORKER_KILL_MID_SAVE: "worker_save",
    ChaosKind.SHM_FULL: "worker_save",  # then the replacement's start finds /dev/shm full
}
FLUSH_THREADS = 8  # requests at once that evict the engines' own caches (one batch)
# Faults a node suffers as it stages a load (NodeChaos.after_get).
_AT_LOAD = {ChaosKind.EVICT_MID_REQUEST, ChaosKind.DISK_CORRUPT_PAGE}


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
    `engine_cache_bytes`: its engines' own KV cache, LLMAppArgs.kv_cache_bytes;
    `call_timeout_s`: the engines' node call deadline, FabricSettings.timeout_s)."""

    engine = "vllm"

    def __init__(
        self,
        *args,
        chaos_file: str,
        engine_cache_bytes: int,
        call_timeout_s: float = 5.0,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.chaos_file, self.call_timeout_s = chaos_file, call_timeout_s
        self.engine_cache_bytes = engine_cache_bytes  # each engine's own KV cache
        self._flush: list[list[int]] = []  # prompts that evict the engines' own caches
        self.faults = StepFaultFile(chaos_file)  # what the engines' connectors read
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
                return self._kill_worker(_WORKER_STEP[kind], shm_full=kind is ChaosKind.SHM_FULL)
            if kind is ChaosKind.NODE_KILL_MID_LOAD:
                return self._kill_node_mid_load(rng)
            if kind is ChaosKind.NODE_STALL:
                return self._stall_node(rng)
        except (RayError, GetTimeoutError, ProcessLookupError) as e:  # a node restarting
            self.log(f"  {kind.value} not injected: {e}")
            return False
        return super()._inject(kind, rng, work)

    # --- the vLLM path's faults -----------------------------------------------------------
    def _kill_worker(self, step: str, shm_full: bool = False) -> bool:
        """Arm a SIGKILL at `step` for whichever engine reaches it first (with `shm_full`,
        also a full /dev/shm where the engine Serve starts in its place reserves its
        staging: that start fails, and Serve's next must start). True once it fired and an
        engine runs in its place (the next fault then finds the app whole); False,
        disarmed, if no engine reached the step in time."""
        engines = self._engines()
        full = {ConnectorStep.STAGING.value: FULL} if shm_full else {}
        self.faults.arm({step: KILL, **full})
        if not self._fired(step, provoke=step == ConnectorStep.WORKER_LOAD.value):
            self.faults.disarm()
            return False
        if shm_full and not self._fired(ConnectorStep.STAGING.value, self.restart_wait_s):
            self.log(f"  no engine start reserved staging in {self.restart_wait_s} s")
        self.faults.disarm()
        deadline = time.monotonic() + self.restart_wait_s
        while time.monotonic() < deadline:
            now = self._engines()
            if len(now) >= len(engines) and now != engines:
                return True
            time.sleep(1.0)
        self.log(f"  no engine replaced the one killed at {step} in {self.restart_wait_s} s")
        return True

    def _await_fired(self, kind: ChaosKind, actor, before: int) -> bool:
        """A fault armed at a node's load waits for loads brought on (`_provoke_loads`):
        the engines' own caches answer the workload's prompts without the fabric, so the
        workload alone may stage none on that node in `fire_wait_s`."""
        if kind not in _AT_LOAD:
            return super()._await_fired(kind, actor, before)
        return self._until(
            lambda: self._fired_since(actor, before, 0.0), self.fire_wait_s, provoke=True
        )

    def _fired(self, step: str, wait_s: float | None = None, provoke: bool = False) -> bool:
        """Whether the fault armed at `step` fired within `wait_s` (fire_wait_s); with
        `provoke`, loads are brought on meanwhile (`_provoke_loads`)."""
        wait_s = self.fire_wait_s if wait_s is None else wait_s
        return self._until(lambda: step not in self.faults.armed(), wait_s, provoke)

    def _until(self, done: Callable[[], bool], wait_s: float, provoke: bool) -> bool:
        """Whether `done()` within `wait_s`; with `provoke`, loads are brought on meanwhile."""
        deadline = time.monotonic() + wait_s
        while not done():
            if time.monotonic() >= deadline:
                return False
            if provoke:
                self._provoke_loads()
            else:
                time.sleep(0.05)
        return True

    def _provoke_loads(self) -> None:
        """Bring on loads from the nodes. The engines' own caches hold the workload's
        prompts and answer them without the fabric: so first fill those caches twice over,
        at once, with requests under fresh salts (nothing cached matches them), which
        evicts the cached prompts' blocks; then send the cached prompts, which the engines
        now load from their nodes. A request that fails here is not the run's to count."""
        flush = self._flush_prompts()
        with ThreadPoolExecutor(FLUSH_THREADS) as pool:
            list(pool.map(lambda tokens: self._send(tokens, cache=False), flush))
            list(pool.map(lambda tokens: self._send(tokens, cache=True), self.prompts))

    def _flush_prompts(self) -> list[list[int]]:
        """Prompts as long as the workload's longest, of the workload's tokens, that fill
        every engine's own cache twice (its bytes over a token's KV in the nodes' layout,
        which is the engines' own)."""
        if not self._flush:
            layout = ray.get(next(iter(self._nodes().values())).layout.remote(), timeout=30)
            token_bytes = sum(layout.page_bytes(p) for p in layout.pools) // layout.page_size
            engines = max(1, len(self._engines()))
            need = 2 * engines * self.engine_cache_bytes // token_bytes
            length = max(len(p) for p in self.prompts)
            stream = [t for p in self.prompts for t in p]
            for i in range(-(-need // length)):
                start = (i * 7) % len(stream)
                self._flush.append((stream[start:] + stream[:start])[:length])
        return self._flush

    def _send(self, tokens: list[int], cache: bool) -> None:
        client = LLMClient(self.endpoint, timeout_s=120.0)
        try:
            client.complete(self.model, tokens, 1, cache=cache, namespace=NAMESPACE)
        except (OSError, RuntimeError, ValueError) as e:
            self.log(f"  a request bringing on loads failed: {e}")
        finally:
            client.close()

    def _kill_node_mid_load(self, rng: random.Random) -> bool:
        """A node dies (-9) once its next load is staged, before it answers; True once it
        died and Ray started it again. Under load a round of loads may outlast
        `fire_wait_s`, so a node found dead, even as it is told to calm down, counts as
        killed, and its restart is waited for (`restart_wait_s`)."""
        nodes = self._nodes()
        name = rng.choice(sorted(nodes))
        actor = nodes[name]
        before = _pid(actor)
        ray.get(actor.inject.remote(ChaosAction(exit_after_get=True)), timeout=CALL_TIMEOUT_S)
        deadline = time.monotonic() + self.fire_wait_s
        while _pid_or_none(actor) == before:
            if time.monotonic() >= deadline:
                try:
                    ray.get(actor.calm.remote(), timeout=CALL_TIMEOUT_S)
                except (RayError, GetTimeoutError):
                    break  # it died as it was told to calm down
                if _pid_or_none(actor) == before:
                    return False
                break
            self._provoke_loads()
        deadline = time.monotonic() + self.restart_wait_s
        while _pid_or_none(actor) in (None, before):
            if time.monotonic() >= deadline:
                self.log(f"  {name} did not restart in {self.restart_wait_s} s")
                break
            time.sleep(0.1)
        return True

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

    def _engines(self) -> set[str]:
        """The staging prefixes of this app's running engines (those announced to its node
        actors: another app's engines may share the host)."""
        return _running_engines(set(self._nodes()))

    # --- checks -----------------------------------------------------------------------------
    def _calm(self) -> None:
        self.faults.disarm()
        super()._calm()

    def _leaked_staging_files(self, wait_s: float = 120.0) -> int:
        """Staging files and records in /dev/shm of this app's engines that are not
        running, once the nodes had `wait_s` to reap them (a node restarted by a fault
        reaps at its start)."""
        deadline = time.monotonic() + wait_s
        while True:
            leaked = orphans(set(self._nodes())) - self.earlier
            if not leaked or time.monotonic() >= deadline:
                if leaked:
                    self.log(f"staging files no running engine owns: {sorted(leaked)[:8]}")
                return len(leaked)
            time.sleep(1.0)


def orphans(nodes: set[str] | None = None) -> set[str]:
    """Staging files and records in /dev/shm of engines that are not running; with
    `nodes`, not those of other node actors' engines (files of no record, an engine whose
    start failed before it wrote one, count as anyone's)."""
    records = EngineProcess.records()
    owned = {
        p.staging.prefix
        for p in records
        if p.alive() or (nodes is not None and p.node not in nodes)
    }
    return {
        f.name
        for f in staging.SHM_DIR.glob("kvf-vllm-*")
        if not any(f.name.startswith(prefix) for prefix in owned)
    }


def _running_engines(nodes: set[str]) -> set[str]:
    """The staging prefixes of the running engines announced to `nodes` on this host."""
    return {p.staging.prefix for p in EngineProcess.records() if p.alive() and p.node in nodes}


def remove_orphans(keep: set[str]) -> None:
    """Unlink the staging files and records of engines that are not running, but `keep`:
    an app shut down with its nodes leaves its engines' records (no node reaps them)."""
    for name in orphans() - keep:
        (staging.SHM_DIR / name).unlink(missing_ok=True)


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=CALL_TIMEOUT_S)


def _pid_or_none(actor) -> int | None:
    """The actor's process id; None while it is dead or restarting."""
    try:
        return _pid(actor)
    except (RayError, GetTimeoutError):
        return None
