"""NodeChaos: the node actor's hooks (actors/node/hooks.py) for chaos runs, ours and users'.

A node started with `NodeConfig(hooks=NodeChaos)` (the Serve app's `chaos` arg) reads
through a FaultyTransport and counts its cache's reservation points, both idle until an
action arms them; event faults act on what it sends the index next. `ChaosAction`s come
through the actor's `inject`. A node with a disk tier gives its store's write hook to
DiskFaults. A scripted start (tests): `functools.partial(NodeChaos,
script=[Fault(...)])`, picklable like the class itself."""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Sequence

from kvfabric.core.cache.disk_store import DiskStore
from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.index.events import EventBatch
from kvfabric.transport.base import Transport

from .action import ChaosAction
from .allocation import AllocationFaults
from .disk import DiskFaults
from .events import EventMangler
from .faulty_transport import FaultyTransport
from .transfer import Fault, FaultPlan

if TYPE_CHECKING:  # the actors layer imports Ray: only its types are needed here
    from kvfabric.actors.node.node_actor import NodeConfig


HOOKS = "kvfabric.deploy.chaos.faults:NodeChaos"  # as a connector setting names it (node_hooks)


class NodeChaos:
    def __init__(self, config: NodeConfig, script: Sequence[Fault | None] = ()) -> None:
        self.capacities = config.capacities
        self.allocation = AllocationFaults()
        self.events = EventMangler()
        self.disk_faults = DiskFaults()
        self.faulty: FaultyTransport | None = None
        self._plan = FaultPlan(script)
        self._evict_after_get = False
        self._exit_after_get = False
        self._evictions = 0
        self._transport_done = 0  # faults of transport plans since replaced

    # --- the hooks ----------------------------------------------------------------------
    def transport(self, inner: Transport) -> Transport:
        self.faulty = FaultyTransport(inner, self._plan)
        return self.faulty

    def reserve(self, pool: PoolName, tier: Tier) -> None:
        self.allocation(pool, tier)

    def send(self, batches: list[tuple[int, EventBatch]]) -> list[tuple[int, EventBatch]]:
        return self.events(batches)

    def disk(self, store: DiskStore) -> None:
        self.disk_faults.attach(store)

    def after_get(self, cache: NodeCache) -> None:
        """Evict every unlocked page when armed: what happens to a request's match when
        other requests and peers' exports crowd the pools between its get and its put.
        Or kill this process (-9) there: a node actor dying mid-load, its answer unsent.
        Or flip a byte of a page on disk, then evict: the memory copies gone, the next
        hit on that page reads it from disk (and must find it corrupt)."""
        if self._exit_after_get:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.disk_faults.corrupt():
            self._evict_after_get = True
        if not self._evict_after_get:
            return
        self._evict_after_get = False
        self._evictions += 1
        for pool, capacity in self.capacities.items():
            for tier, pages in ((Tier.DEVICE, capacity.device), (Tier.HOST, capacity.host)):
                if pages:
                    cache.evict(pool, tier, pages)

    # --- arming ---------------------------------------------------------------------------
    def arm(self, action: ChaosAction) -> None:
        if not isinstance(action, ChaosAction):
            raise TypeError(f"a chaos node takes a ChaosAction, got {type(action).__name__}")
        if action.transport is not None:
            self._replace_plan(FaultPlan([action.transport]))
        if action.alloc_point:
            self.allocation.arm(action.alloc_point)
        if action.events is not None:
            self.events.arm(action.events)
        if action.disk is not None:
            self.disk_faults.arm(action.disk)
        self._evict_after_get = action.evict_after_get
        self._exit_after_get = action.exit_after_get

    def calm(self) -> None:
        """Disarm every fault (held-back events go out with the next send)."""
        self._replace_plan(FaultPlan())
        self.allocation.disarm()
        self.events.armed = None
        self.disk_faults.disarm()
        self._evict_after_get = self._exit_after_get = False

    def fired(self) -> int:
        """How many injected faults have acted so far (armed ones count once they hit)."""
        transport = self._transport_done + len(self._plan.injected)
        applied = self.allocation.injected + self.events.applied + self.disk_faults.injected
        return transport + applied + self._evictions

    def _replace_plan(self, plan: FaultPlan) -> None:
        self._transport_done += len(self._plan.injected)
        self._plan = plan
        if self.faulty is not None:
            self.faulty.plan = plan
