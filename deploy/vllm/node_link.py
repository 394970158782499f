"""The scheduler side's handle on its node's NodeCacheActor and on the fabric's index:
every call bounded, or started without waiting and polled."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Sequence, cast

from kvfabric.actors.node.engine_process import EngineProcess
from kvfabric.fabric import KVLayout
from kvfabric.transport.staging import StagingSpec

from .jobs import FabricSettings

if TYPE_CHECKING:
    from kvfabric.actors.fabric import FabricClient, PendingLookup
    from ray.actor import ActorHandle

    from .event_feed import EngineEventFeed
    from .index_sink import FeedSpec

log = logging.getLogger(__name__)


class NodeLink:
    """Connects at first use. A node that cannot be reached, or whose layout's
    fingerprint differs from the engine's (another model, dtype or KV tensor layout),
    leaves the connector off: the engine computes everything itself."""

    def __init__(
        self,
        settings: FabricSettings,
        layout: KVLayout,
        feed: FeedSpec | None = None,
        staging: StagingSpec | None = None,
    ) -> None:
        self.settings = settings
        self.layout = layout
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

    def ready(self) -> bool:
        if self.actor is not None:
            return True
        if self.disabled:
            return False
        try:
            self._connect()
        except Exception as e:  # unreachable: serve without the fabric
            self.disabled = f"cannot reach {self.settings.node_actor}: {e!r}"
        if self.disabled:
            log.warning("FabricConnector off: %s", self.disabled)
        return self.actor is not None

    def _connect(self) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(
                address=self.settings.ray_address or None,
                namespace=self.settings.ray_namespace,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        actor = ray.get_actor(self.settings.node_actor, namespace=self.settings.ray_namespace)
        theirs = cast(KVLayout, ray.get(actor.layout.remote(), timeout=self.settings.timeout_s))
        if theirs.fingerprint != self.layout.fingerprint:
            self.disabled = (
                f"{self.settings.node_actor} holds layout {theirs.to_dict()}, "
                f"this engine needs {self.layout.to_dict()}"
            )
            return
        self.actor = actor
        if self.feed_spec is not None:
            self._start_feed(self.feed_spec)
        if self.staging is not None:
            # The node watches this process: if it ends without a word, the node drops its
            # staging pages and the index its entries (actors/node/engine_process.py).
            pages = self.feed.pages if self.feed is not None else None
            self.tell(
                "engine_started",
                EngineProcess.this_process(
                    self.staging, pages.node if pages else "", pages.epoch if pages else 0
                ),
            )

    def _start_feed(self, spec: FeedSpec) -> None:
        import ray
        from kvfabric.actors.directory import DIRECTORY

        try:
            directory = ray.get_actor(DIRECTORY, namespace=self.settings.ray_namespace)
            self.feed = spec.start(directory, self.name, self.layout)
        except Exception as e:  # no feed: the index does not know this engine's own cache
            log.warning("FabricConnector: the engine's KV events do not reach the index: %r", e)

    def call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=self.settings.timeout_s)

    def submit(self, method: str, *args: Any) -> Any:
        """Start a call; `finished` says when it has answered, `result` gives the answer."""
        return getattr(self.actor, method).remote(*args)

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
        from kvfabric.actors.fabric import FabricClient

        client = FabricClient.connect(timeout_s=self.settings.timeout_s)
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
        from kvfabric.actors.directory import NAMESPACE

        if self.actor is None:
            raise RuntimeError("not connected to the node (ready first)")
        handle = self._peers.get(peer)
        if handle is None:
            handle = self._peers[peer] = ray.get_actor(peer, namespace=NAMESPACE)
        return self.actor.fetch.remote(handle, peer, list(tokens), namespace)

    def wait_any(self, calls: list, timeout_s: float) -> int:
        """Wait until one of `calls` answers or `timeout_s` passes; how many answered."""
        import ray

        return len(ray.wait(calls, num_returns=1, timeout=timeout_s)[0])
