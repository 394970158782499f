"""The chaos harness: a seeded schedule of faults over a running fabric while
requests flow through the Serve app, then checks that nothing was lost.

Each fault is injected where it bites: a transfer fault is armed on a node and
a fetch into that node follows at once; an allocation fault fails one of the
node's next reservation points; event faults mangle its next batches to the
index. Requests flow meanwhile (workload.py). After the last fault and a quiet
period it checks every request completed with the uncached output, no page
leaked or is owned twice, no lease outlived its TTL, and how long the index
took to agree with the nodes (report.py).
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from typing import Callable, Sequence, TypeVar, cast

import ray
from kvfabric.actors.client import FabricClient
from kvfabric.actors.directory import (
    CALL_TIMEOUT_S,
    DIRECTORY,
    NAMESPACE,
    node_actor_name,
    shard_name,
)
from kvfabric.core.index.routes import RouteTable
from kvfabric.deploy.harness.cluster import Endpoint
from kvfabric.deploy.serving.cache_namespace import cache_namespace
from kvfabric.deploy.serving.engine_identity import is_engine
from ray.exceptions import GetTimeoutError, RayError

from .faults import ChaosAction, DiskFault, EventFault, Fault, FaultKind
from .plan import ENGINE_KINDS, ChaosKind, schedule
from .report import ChaosReport
from .workload import NAMESPACE as WORKLOAD_NAMESPACE
from .workload import Workload

T = TypeVar("T")


class ChaosHarness:
    """Faults over a running fabric (`kvfabric up`-style, nodes started with NodeChaos hooks:
    the Serve app's `chaos` arg).

    `cluster`: a `ray.cluster_utils.Cluster` for node removal, or None (that fault
    is then skipped)."""

    engine = "reference"  # what the app runs: which faults it can suffer (plan.ENGINE_KINDS)

    def __init__(
        self,
        endpoint: Endpoint,
        model: str,
        prompts: list[list[int]],
        *,
        cluster=None,
        node_args: dict | None = None,
        log: Callable[[str], None] = lambda _: None,
        ray_namespace: str = NAMESPACE,
    ) -> None:
        """`ray_namespace`: the fabric's Ray namespace."""
        self.endpoint, self.model, self.prompts = endpoint, model, prompts
        self.cluster, self.node_args, self.log = cluster, node_args or {}, log
        self.ray_namespace = ray_namespace
        # where the fabric files the workload's cached requests' pages
        self.cache_namespace = cache_namespace(WORKLOAD_NAMESPACE)
        self.client = FabricClient.connect(timeout_s=5.0, namespace=ray_namespace)
        self.directory = ray.get_actor(DIRECTORY, namespace=ray_namespace)
        self.injected: dict[str, int] = {}
        self.fire_wait_s = 5.0  # how long an armed fault may wait for the step it hits

    # --- the run -------------------------------------------------------------------------
    def run(
        self,
        seed: int,
        faults: int,
        kinds: Sequence[ChaosKind] | None = None,
        interval_s: float = 0.3,
        quiet_s: float = 3.0,
        threads: int = 2,
        attempts_per_fault: int = 4,
    ) -> ChaosReport:
        """Inject `faults` faults. One that finds nothing to act on (no prompt held
        elsewhere yet, an armed fault that never fired) is disarmed and tried again
        later in the schedule, not counted; at most `attempts_per_fault` tries each."""
        rng = random.Random(seed)
        self.injected = {}
        plan = deque(schedule(seed, faults, kinds or ENGINE_KINDS[self.engine]))
        attempts, limit = 0, attempts_per_fault * faults
        started = time.monotonic()
        last_fault = started
        work = self._workload(threads)
        work.start()
        try:
            while plan and attempts < limit:
                kind = plan.popleft()
                attempts += 1
                if self._inject(kind, rng, work):
                    self.injected[kind.value] = self.injected.get(kind.value, 0) + 1
                    last_fault = time.monotonic()
                    self.log(f"fault {sum(self.injected.values())}/{faults}: {kind.value}")
                else:
                    plan.append(kind)  # nothing to act on now: later
                time.sleep(interval_s)
        finally:
            work.stop()
        self._calm()
        # The index cannot agree before the nodes stop changing: the split says how much of
        # the convergence was the workload's in-flight requests ending.
        drained = round(time.monotonic() - last_fault, 3)
        converged = self._converged_after(since=last_fault)
        time.sleep(quiet_s)  # leases of the last fetches run out or are released
        audit = self._audit()
        return ChaosReport(
            seed,
            sum(self.injected.values()),
            attempts,
            work.requests,
            work.failed,
            work.retried,
            work.app_retried,
            work.wrong,
            audit["leaked"],
            audit["double_owned"],
            audit["leases_overdue"],
            converged,
            drained,
            self._leaked_staging_files(),
            round(time.monotonic() - started, 1),
            dict(self.injected),
        )

    def _workload(self, threads: int) -> Workload:
        return Workload(self.endpoint, self.model, self.prompts, threads)

    # --- faults ----------------------------------------------------------------------------
    def _inject(self, kind: ChaosKind, rng: random.Random, work: Workload) -> bool:
        """Inject one fault of `kind`; False when it found nothing to act on."""
        nodes = self._nodes()
        if not nodes:
            return False
        # A fault the node suffers at its own next step goes where requests are flowing;
        # a transfer fault, to a node that another node's answers can be fetched into.
        if kind in _ARMED:
            likely = [n for n in work.busy_nodes() if n in nodes]
        elif kind in _TRANSFER:
            likely = [n for n in sorted(nodes) if work.served_elsewhere(n)]
        else:
            likely = []
        name = rng.choice(likely or sorted(nodes))
        actor = nodes[name]
        try:
            if kind is ChaosKind.KILL_NODE_ACTOR:
                ray.kill(actor, no_restart=False)
            elif kind is ChaosKind.KILL_SHARD:
                shard = shard_name(rng.randrange(_shard_count(self.directory)))
                ray.kill(ray.get_actor(shard, namespace=self.ray_namespace), no_restart=False)
            elif kind is ChaosKind.REMOVE_READD_NODE:
                return self._remove_readd(rng)
            elif kind is ChaosKind.KILL_DIRECTORY_MID_REBALANCE:
                self._kill_directory_mid_rebalance(rng)
            elif kind is ChaosKind.CROSS_FETCH:
                return self._cross_fetch(nodes, rng, work)
            elif kind is ChaosKind.DISK_KILL_MID_WRITE:
                return self._kill_mid_disk_write(actor)
            else:
                return self._armed(kind, name, actor, rng, work)
            return True
        except (RayError, GetTimeoutError, ValueError) as e:
            self.log(f"  {kind.value} on {name} not injected: {e}")
            return False

    def _armed(self, kind: ChaosKind, name: str, actor, rng: random.Random, work: Workload) -> bool:
        """Arm a fault the node suffers at its own next step; True once it fired. A
        transfer fault is followed at once by a fetch into the node of a prompt another
        node served; one that has not fired within `fire_wait_s` is disarmed."""
        held = work.served_elsewhere(name)
        if kind in _TRANSFER and not held:
            return False
        before = ray.get(actor.fired.remote(), timeout=CALL_TIMEOUT_S)
        ray.get(actor.inject.remote(_action(kind, rng)), timeout=CALL_TIMEOUT_S)
        if kind in _TRANSFER:
            # A prompt the node already holds reads nothing: try others until one does.
            for tokens in rng.sample(held, min(len(held), 4)):
                self.client.fetch(tokens, self.cache_namespace, into=name)
                if self._fired_since(actor, before, 0.0):
                    return True
        if self._await_fired(kind, actor, before):
            return True
        ray.get(actor.calm.remote(), timeout=CALL_TIMEOUT_S)
        return False

    def _await_fired(self, kind: ChaosKind, actor, before: int) -> bool:
        """Whether the fault of `kind` armed on `actor` acted within `fire_wait_s` (the
        workload's requests reach every step a fault is armed at)."""
        return self._fired_since(actor, before, self.fire_wait_s)

    def _kill_mid_disk_write(self, actor) -> bool:
        """Arm the kill at the node's next disk write (requests write their new last
        pages through); True once it died and Ray restarted it (a new epoch)."""
        before = ray.get(actor.stats.remote(), timeout=CALL_TIMEOUT_S)["epoch"]
        ray.get(
            actor.inject.remote(ChaosAction(disk=DiskFault.KILL_MID_WRITE)), timeout=CALL_TIMEOUT_S
        )
        deadline = time.monotonic() + self.fire_wait_s
        while time.monotonic() < deadline:
            try:
                ray.get(actor.ping.remote(), timeout=1.0)
            except (RayError, GetTimeoutError):
                break  # it died: wait for the new one below
            time.sleep(0.05)
        else:
            try:
                ray.get(actor.calm.remote(), timeout=CALL_TIMEOUT_S)
            except (RayError, GetTimeoutError):
                pass  # it died as it was told to calm down: the check below says so
        stats = _retry(lambda: ray.get(actor.stats.remote(), timeout=CALL_TIMEOUT_S))
        return stats["epoch"] != before

    @staticmethod
    def _fired_since(actor, before: int, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while ray.get(actor.fired.remote(), timeout=CALL_TIMEOUT_S) == before:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _cross_fetch(self, nodes: dict, rng: random.Random, work: Workload) -> bool:
        """Two nodes fetch, at the same time, a prompt the other one served."""
        names = sorted(nodes)
        rng.shuffle(names)
        for a, b in ((a, b) for a in names for b in names if a != b):
            into_a, into_b = work.served_by(b), work.served_by(a)
            if into_a and into_b:
                pulls = [
                    threading.Thread(
                        target=self.client.fetch,
                        daemon=True,
                        args=(rng.choice(ks), self.cache_namespace),
                        kwargs={"into": into},
                    )
                    for into, ks in ((a, into_a), (b, into_b))
                ]
                for t in pulls:
                    t.start()
                for t in pulls:
                    t.join(timeout=60)
                return True
        return False

    def _kill_directory_mid_rebalance(self, rng: random.Random) -> None:
        """Start a rebalance that splits on any imbalance, kill the directory somewhere
        in its steps, and wait until the restarted one answers."""
        before = cast(int, ray.get(self.directory.incarnation.remote(), timeout=CALL_TIMEOUT_S))
        self.directory.rebalance.remote(1.0)
        time.sleep(rng.uniform(0.0, 0.05))
        ray.kill(self.directory, no_restart=False)  # asynchronous: wait for the new process
        _retry(
            lambda: ray.get(self.directory.incarnation.remote(), timeout=CALL_TIMEOUT_S),
            until=lambda pid: pid != before,
        )

    def _remove_readd(self, rng: random.Random) -> bool:
        if self.cluster is None:
            return False
        workers = [n for n in self.cluster.worker_nodes]
        if not workers:
            return False
        gone = rng.choice(workers)
        self.log(f"  removing the Ray node of {node_actor_name(gone.node_id)}")
        self.cluster.remove_node(gone)
        self.cluster.add_node(**self.node_args)
        self.cluster.wait_for_nodes()
        return True

    def _calm(self) -> None:
        for actor in self._nodes().values():
            try:
                ray.get(actor.calm.remote(), timeout=CALL_TIMEOUT_S)
            except (RayError, GetTimeoutError):
                pass  # restarting: a new actor has nothing armed

    # --- checks ----------------------------------------------------------------------------
    def _nodes(self) -> dict:
        # The directory may be restarting (a fault of ours): wait for it, within bounds.
        names: list[str] = _retry(
            lambda: ray.get(self.directory.node_names.remote(), timeout=CALL_TIMEOUT_S)
        )
        out = {}
        for name in names:
            try:
                out[name] = ray.get_actor(name, namespace=self.ray_namespace)
            except ValueError:
                pass  # died since the directory listed it: nothing to inject into
        return out

    def _converged_after(self, since: float, limit_s: float = 60.0) -> float:
        """Seconds from `since` until the index answers, for every prompt, what the
        nodes hold (inf if not within `limit_s`)."""
        deadline = time.monotonic() + limit_s
        disagreement = ""
        while time.monotonic() < deadline:
            disagreement = self._disagreement()
            if not disagreement:
                return round(time.monotonic() - since, 3)
            time.sleep(0.1)
        self.log(f"the index did not converge within {limit_s} s: {disagreement}")
        return float("inf")

    def _disagreement(self) -> str:
        """Where the index and the nodes disagree now ('' where they agree)."""
        nodes = self._nodes()
        try:
            for k, tokens in enumerate(self.prompts):
                truth = {
                    n: p
                    for n, p in zip(
                        nodes,
                        ray.get(
                            [a.match.remote(tokens, self.cache_namespace) for a in nodes.values()],
                            timeout=CALL_TIMEOUT_S,
                        ),
                    )
                    if p
                }
                index = {
                    m.node: m.pages
                    for m in self.client.lookup(tokens, self.cache_namespace)
                    if not is_engine(m.node)  # engines' own caches: not the nodes'
                }
                if index != truth:
                    return (
                        f"prompt {k}: the index says {index}, the nodes hold {truth} "
                        f"(the directory lists {sorted(nodes)})"
                    )
        except (RayError, GetTimeoutError) as e:
            return f"{type(e).__name__}: {e}"
        return ""

    def _leaked_staging_files(self) -> int:
        """Staging files no running engine owns (the reference engine stages nothing)."""
        return 0

    def _audit(self) -> dict:
        total = {"leaked": 0, "double_owned": 0, "leases_overdue": 0}
        for actor in self._nodes().values():
            a = _retry(
                lambda: ray.get(actor.audit.remote(), timeout=CALL_TIMEOUT_S)
            )  # may be restarting
            for key in total:
                total[key] += a[key]
        return total


_TRANSFER = {
    ChaosKind.TRANSFER_FAIL_AFTER,
    ChaosKind.TRANSFER_HANG,
    ChaosKind.TRANSFER_CORRUPT,
    ChaosKind.SLOW_PEER,
}
_ARMED = {
    ChaosKind.ALLOC_FAIL,
    ChaosKind.EVICT_MID_REQUEST,
    ChaosKind.EVENT_DROP,
    ChaosKind.EVENT_DUPLICATE,
    ChaosKind.EVENT_REORDER,
    ChaosKind.DISK_CORRUPT_PAGE,
    ChaosKind.DISK_FULL,
}
_DISK = {
    ChaosKind.DISK_CORRUPT_PAGE: DiskFault.CORRUPT_PAGE,
    ChaosKind.DISK_FULL: DiskFault.FULL,
}


def _action(kind: ChaosKind, rng: random.Random) -> ChaosAction:
    """What a node is told to suffer for an armed kind of fault."""
    if kind is ChaosKind.ALLOC_FAIL:
        return ChaosAction(alloc_point=rng.randint(1, 3))
    if kind is ChaosKind.EVICT_MID_REQUEST:
        return ChaosAction(evict_after_get=True)
    if kind in _DISK:
        return ChaosAction(disk=_DISK[kind])
    if kind in (ChaosKind.EVENT_DROP, ChaosKind.EVENT_DUPLICATE, ChaosKind.EVENT_REORDER):
        return ChaosAction(events=EventFault(kind.value.removeprefix("event_")))
    return ChaosAction(
        transport={
            ChaosKind.TRANSFER_FAIL_AFTER: Fault(FaultKind.FAIL_AFTER, after=rng.randrange(4)),
            ChaosKind.TRANSFER_HANG: Fault(FaultKind.HANG, delay_s=rng.uniform(0.1, 1.0)),
            ChaosKind.TRANSFER_CORRUPT: Fault(FaultKind.CORRUPT),
            ChaosKind.SLOW_PEER: Fault(FaultKind.DELAY, delay_s=rng.uniform(0.05, 0.5)),
        }[kind]
    )


def _retry(
    call: Callable[[], T], until: Callable[[T], bool] = lambda _: True, limit_s: float = 60.0
) -> T:
    """`call()`'s first answer that `until` accepts; Ray errors count as no answer yet.
    Raises TimeoutError after `limit_s`."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            answer = call()
            if until(answer):
                return answer
        except (RayError, GetTimeoutError):
            pass  # restarting or busy: ask again below, until the deadline
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer within {limit_s} s")
        time.sleep(0.2)


def _shard_count(directory) -> int:
    return RouteTable.decode(ray.get(directory.get_routes.remote(), timeout=CALL_TIMEOUT_S)).shards
