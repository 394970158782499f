"""NodeHooks: the seams where tests and chaos runs act on a node actor.

A node is built with at most one (`NodeConfig.hooks`, a factory called in the actor's
process); production passes none, and then none of these is called. The injectors
themselves live in kvfabric.deploy.chaos."""

from __future__ import annotations

from typing import Any, Protocol

from kvfabric.core.cache.disk_store import DiskStore
from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.transport.base import Transport

from .index_link import Sends


class NodeHooks(Protocol):
    def transport(self, inner: Transport) -> Transport:
        """The transport the node uses: `inner` or a wrapper of it (called once)."""
        ...

    def reserve(self, pool: PoolName, tier: Tier) -> None:
        """The cache's reservation hook: raising fails that reservation (it rolls back)."""
        ...

    def send(self, batches: Sends) -> Sends:
        """The (shard, batch) pairs to really send, given those a publish would send."""
        ...

    def disk(self, store: DiskStore) -> None:
        """The node's disk store, as it opens (only a node with a disk tier): the hooks
        may act at the steps of its writes (`store.hook`)."""
        ...

    def after_get(self, cache: NodeCache) -> None:
        """Called under the cache mutex once a get has its answer, before its publish."""
        ...

    def arm(self, action: Any) -> None:
        """Take an action to suffer from now on (the actor's `inject`)."""
        ...

    def calm(self) -> None:
        """Disarm everything armed."""
        ...

    def fired(self) -> int:
        """How many armed actions have acted so far."""
        ...
