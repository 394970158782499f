"""The scheduler side's handle on its node's NodeCacheActor: every call bounded."""
from __future__ import annotations

import logging
from typing import Any

from fabric import KVLayout

from .jobs import FabricSettings

log = logging.getLogger(__name__)


class NodeLink:
    """Connects at first use. A node that cannot be reached, or whose layout's
    fingerprint differs from the engine's (another model, dtype or KV tensor layout),
    leaves the connector off: the engine computes everything itself."""

    def __init__(self, settings: FabricSettings, layout: KVLayout) -> None:
        self.settings = settings
        self.layout = layout
        self.actor = None
        self.disabled = "" if settings.node_actor else "no node_actor configured"

    def ready(self) -> bool:
        if self.actor is not None:
            return True
        if self.disabled:
            return False
        try:
            self._connect()
        except Exception as e:       # unreachable: serve without the fabric
            self.disabled = f"cannot reach {self.settings.node_actor}: {e!r}"
        if self.disabled:
            log.warning("FabricConnector off: %s", self.disabled)
        return self.actor is not None

    def _connect(self) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=self.settings.ray_address or None, namespace=self.settings.ray_namespace,
                     log_to_driver=False, logging_level=logging.WARNING)
        actor = ray.get_actor(self.settings.node_actor, namespace=self.settings.ray_namespace)
        theirs = ray.get(actor.layout.remote(), timeout=self.settings.timeout_s)
        if theirs.fingerprint != self.layout.fingerprint:
            self.disabled = (f"{self.settings.node_actor} holds layout {theirs.to_dict()}, "
                             f"this engine needs {self.layout.to_dict()}")
            return
        self.actor = actor

    def call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=self.settings.timeout_s)

    def submit(self, method: str, *args: Any) -> Any:
        """Start a call; `finished` says when it has answered, `result` gives the answer."""
        return getattr(self.actor, method).remote(*args)

    def finished(self, calls: list) -> list:
        import ray

        done, _ = ray.wait(calls, num_returns=len(calls), timeout=0)
        return done

    def result(self, call: Any) -> Any:
        import ray

        return ray.get(call, timeout=0)
