"""The scheduler side's handle on its node's NodeCacheActor and on the fabric's index:
every call bounded, or started without waiting and polled.

It connects when the engine starts (`start`), to the fabric of the engine's KV
identity: in the Ray namespace the layout's fingerprint names, started by the first
engine of that identity (actors/launch.py's `ensure`), so the node's layout is the one
the engine announced, never one guessed from its config files. A node that caches
another layout, or none reachable, fails the engine's start with an error that says
why: an engine is never served silently uncached, nor from another model's pages."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, cast

from kvfabric.actors.node.engine_process import EngineProcess
from kvfabric.core.cache.layout import KVLayout
from kvfabric.transport.staging import StagingSpec

from .jobs import FabricSettings

if TYPE_CHECKING:
    from kvfabric.actors.client import FabricClient, PendingLookup
    from kvfabric.deploy.vllm.events.event_feed import EngineEventFeed
    from kvfabric.deploy.vllm.events.index_sink import FeedSpec
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)


class FabricUnavailable(RuntimeError):
    """The engine's fabric cannot be reached or caches another layout: it does not start."""


class NodeLink:
    """`start` connects (tests connect at first use, `ready`). Once connected, a failed
    call costs that request its hit; the engine keeps serving."""

    def __init__(
        self,
        settings: FabricSettings,
        layout: KVLayout,
        feed: FeedSpec | None = None,
        staging: StagingSpec | None = None,
        served: str = "",
    ) -> None:
        self.settings = settings
        self.layout = layout
        self.served = served  # the model name the engine serves (announced for routers)
        self.namespace = settings.ray_namespace  # the fabric's, once connected
        self.staging = staging  # the engine's staging pages, announced to the node
        self.feed_spec = feed  # the engine's KV events, fed to the index once connected
        self.feed: EngineEventFeed | None = None
        self.actor: ActorHandle | None = None
        self.disabled = "" if settings.node_actor else "no node_actor configured"
        self.name = settings.node_actor
        self.index: FabricClient | None = (
            None  # the fabric's client for index lookups, at first use
        )
        self.index_off = "" if settings.remote else "remote hits not asked for"
        self._peers: dict[str, Any] = {}
        self.record: Path | None = None  # this engine's record for its node (engine_process.py)

    def start(self, timeout_s: float = 180.0) -> None:
        """Connect now, the fabric of this engine's identity started if none runs; raise
        FabricUnavailable (saying why) if that cannot be done."""
        if self.disabled:
            raise FabricUnavailable(f"FabricConnector: {self.disabled}")
        try:
            self._connect(timeout_s)
        except Exception as e:
            self.disabled = f"cannot use the fabric: {e}"
            raise FabricUnavailable(
                f"FabricConnector: node actor {self.settings.node_actor!r} in Ray namespace "
                f"{self.namespace!r}: {e}"
            ) from e

    def ready(self) -> bool:
        if self.actor is not None:
            return True
        if self.disabled:
            return False
        try:
            self._connect(self.settings.timeout_s)
        except Exception as e:  # unreachable: this request computes its prefix itself
            self.disabled = f"cannot use the fabric: {e!r}"
            log.warning("FabricConnector off: %s", self.disabled)
        return self.actor is not None

    def _connect(self, timeout_s: float) -> None:
        import ray
        from kvfabric.actors.launch import ensure
        from kvfabric.actors.names import layout_namespace
        from kvfabric.actors.served import announce

        if not ray.is_initialized():
            ray.init(
                address=self.settings.ray_address or None,
                namespace=self.settings.ray_namespace,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        s = self.settings
        self.namespace = layout_namespace(self.layout.fingerprint, s.ray_namespace)
        ensure(
            s.node_config(self.layout),
            shards=s.shards,
            cpus_per_actor=s.node_cpus,
            timeout_s=timeout_s,
            watch_s=s.watch_s,
            namespace=self.namespace,
        )
        actor = self._node_actor(timeout_s)
        theirs = cast(KVLayout, ray.get(actor.layout.remote(), timeout=timeout_s))
        differences = self.layout.differences(theirs)
        if differences:
            raise ValueError("it caches another KV layout: " + "; ".join(differences))
        self.actor = actor
        if self.served:
            announce(self.served, self.namespace)
        if self.feed_spec is not None:
            self._start_feed(self.feed_spec)
        if self.staging is not None:
            # The node watches this process: if it ends without a word, the node drops its
            # staging pages and the index its entries (actors/node/engine_process.py). The
            # record beside the staging files tells a restarted node the same.
            pages = self.feed.pages if self.feed is not None else None
            proc = EngineProcess.this_process(
                self.staging,
                pages.node if pages is not None else "",  # (an empty EnginePages is falsy)
                pages.epoch if pages is not None else 0,
                self.settings.node_actor,
                self.layout.fingerprint.hex(),
            )
            self.record = proc.write_record()
            self.tell("engine_started", proc)

    def _node_actor(self, timeout_s: float) -> Any:
        """This node's actor of the fabric, waited for a while: a node that joined the
        cluster after the fabric started gets one at the directory's next watch."""
        import ray

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get_actor(self.settings.node_actor, namespace=self.namespace)
            except ValueError:
                if time.monotonic() >= deadline:
                    raise ValueError(
                        f"no node actor {self.settings.node_actor!r} after {timeout_s:.0f} s"
                    ) from None
                time.sleep(0.2)

    def _start_feed(self, spec: FeedSpec) -> None:
        import ray
        from kvfabric.actors.directory import DIRECTORY

        try:
            directory = ray.get_actor(DIRECTORY, namespace=self.namespace)
            self.feed = spec.start(directory, self.name, self.layout, self.namespace)
        except Exception as e:  # no feed: the index does not know this engine's own cache
            log.warning("FabricConnector: the engine's KV events do not reach the index: %r", e)

    def call(self, method: str, *args: Any) -> Any:
        return self.answer(self.submit(method, *args))

    def submit(self, method: str, *args: Any) -> Any:
        """Start a call; `finished` says when it has answered, `result` gives the answer."""
        return getattr(self.actor, method).remote(*args)

    def answer(self, call: Any) -> Any:
        """A submitted call's answer, waited for up to the deadline (then TimeoutError:
        the call may still run; `finished` says when it has)."""
        import ray

        return ray.get(call, timeout=self.settings.timeout_s)

    def tell(self, method: str, *args: Any) -> None:
        """A call whose answer nobody waits for (lost: the next one says it again)."""
        try:
            getattr(self.actor, method).remote(*args)
        except Exception as e:
            log.debug("fabric %s not sent: %r", method, e)

    def report(self, engine: str, stats: Any) -> None:
        """The connector's counters so far, kept by the node for whoever asks
        (`NodeCacheActor.engine_reports`)."""
        self.tell("engine_report", engine, dataclasses.asdict(stats))

    def finished(self, calls: list) -> list:
        import ray

        done, _ = ray.wait(calls, num_returns=len(calls), timeout=0)
        return done

    def result(self, call: Any) -> Any:
        import ray

        return ray.get(call, timeout=0)

    # --- other nodes, through the fabric's global index -------------------------------------
    def index_ready(self) -> bool:
        """Whether remote hits are on: the fabric's directory answers, for this layout."""
        if self.index is not None:
            return True
        if self.index_off or not self.ready():
            return False
        try:
            self._connect_index()
        except Exception as e:  # no fabric index: hits come from this node only
            self.index_off = f"no fabric index: {e!r}"
        if self.index_off:
            log.warning("FabricConnector: remote hits off: %s", self.index_off)
        return self.index is not None

    def _connect_index(self) -> None:
        from kvfabric.actors.client import FabricClient

        client = FabricClient.connect(timeout_s=self.settings.timeout_s, namespace=self.namespace)
        if client.layout.fingerprint != self.layout.fingerprint:
            self.index_off = f"the fabric's index is for layout {client.layout.to_dict()}"
            return
        self.index = client

    def start_lookup(self, tokens: Sequence[int], namespace: str) -> PendingLookup:
        if self.index is None:
            raise RuntimeError("the fabric's index is not connected (index_ready first)")
        return self.index.start_lookup(tokens, namespace)

    def start_fetch(self, peer: str, tokens: Sequence[int], namespace: str) -> Any:
        """Start this node's fetch of `peer`'s longer prefix of `tokens` (the node's
        transaction: it commits whole or not at all); answers a FetchOutcome value."""
        import ray

        if self.actor is None:
            raise RuntimeError("not connected to the node (ready first)")
        handle = self._peers.get(peer)
        if handle is None:
            handle = self._peers[peer] = ray.get_actor(peer, namespace=self.namespace)
        return self.actor.fetch.remote(handle, peer, list(tokens), namespace)

    def wait_any(self, calls: list, timeout_s: float) -> int:
        """Wait until one of `calls` answers or `timeout_s` passes; how many answered."""
        import ray

        return len(ray.wait(calls, num_returns=1, timeout=timeout_s)[0])
