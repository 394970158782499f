"""The `global` mode of `kvfabric replay`: the fabric as deployed, on the real sharded index.

Every node publishes its page events into the index. The router (FabricScore, as
kvfabric.deploy.serving.router runs it) asks the index who holds how much of the prompt;
when the prefill starts, the node does what the engine does: matches locally, asks the
index for the best remote holder, and fetches from it when
`kvfabric.deploy.placement.plan` says moving beats recomputing. Mooncake's conductor
places requests the same way. With `SimConfig.replication` on, hot prefixes are also
copied ahead of demand (`kvfabric.deploy.sim.replication`).
"""

from __future__ import annotations

from typing import Sequence

from kvfabric.core.cache.layout import Tier
from kvfabric.core.index.answers import NodeMatch
from kvfabric.core.index.match_rule import MatchRule
from kvfabric.core.index.publisher import EventPublisher
from kvfabric.core.index.replication import Chain
from kvfabric.core.index.sharded_index import ShardedIndex
from kvfabric.deploy.placement import FabricScore, NodeView

from .cluster import NAMESPACE, Cluster, Service, SimConfig, SimRequest
from .local_hit import take_local_hit
from .replication import Replicator


class FabricCluster(Cluster):
    def __init__(self, config: SimConfig, router: FabricScore) -> None:
        super().__init__(config, router)
        self.slot = {name: i for i, name in enumerate(self.names)}
        self.index = ShardedIndex(config.shards, MatchRule.of(config.layout))
        self.publishers = [
            EventPublisher(c, name, epoch=1) for c, name in zip(self.caches, self.names)
        ]
        self.lookups = 0
        self.splits = 0
        self.fetches = 0
        self.replicator = (
            Replicator(
                config.replication,
                self.caches,
                self.names,
                config.capacity_pages,
                config.page_tokens,
                self.holders,
                self._publish,
            )
            if config.replication.enabled
            else None
        )
        for i in range(config.nodes):
            self._publish(i)  # batch 0 of every shard says `cleared`: snapshots need a seq

    def lookup(self, req: SimRequest) -> dict[int, NodeMatch]:
        """Node -> its match of the prompt (pages, slowest tier), as the index says."""
        found = self.index.lookup(req.keys)
        self.lookups += 1
        if self.lookups % self.config.rebalance_every == 0:
            self._rebalance()
        return {self.slot[m.node]: m for m in found}

    def views(self, req: SimRequest, loads: Sequence[int]) -> list[NodeView]:
        held, none = self.lookup(req), NodeMatch("", 0, Tier.DEVICE)
        return [
            NodeView(q, m.pages, self.names[i], m.tier)
            for i, q in enumerate(loads)
            for m in (held.get(i, none),)
        ]

    def serve(self, node: int, req: SimRequest, now: float) -> Service:
        c = self.config
        hit = take_local_hit(self.caches[node], req.tokens, NAMESPACE)
        local = hit.pages
        if self.config.host_tokens:
            self._publish(node)  # what came up to the device pushed pages down, or out
        if self.replicator is not None:
            self.replicator.served(now, node, req, local)
        remote = {i: m.pages for i, m in self.lookup(req).items() if i != node}
        src = max(remote, key=lambda i: (remote[i], -i), default=None)
        assert isinstance(self.router, FabricScore)
        plan = self.router.plan(req.request, local, remote[src] if src is not None else 0)
        fetch_s = plan.fetch_s
        if plan.fetched_pages and src is not None:
            # The source serves the export: its pages count as used, as a real export's do.
            # What it sends from disk it reads up first (host pages go out from host memory).
            sent = take_local_hit(
                self.caches[src], req.tokens[: plan.cached_pages * c.page_tokens], NAMESPACE
            )
            from_disk = sum(j >= local for j in sent.positions_on(Tier.DISK))
            if c.host_tokens:
                self._publish(src)
            fetch_s += c.cost.load_s(Tier.DISK, c.page_bytes.fetch(from_disk))
            self.fetches += 1
            if self.replicator is not None:
                self.replicator.fetched(now, node, src, req, plan.cached_pages)
        return self.service(req, hit, plan.cached_pages, plan.fetched_bytes, fetch_s)

    def complete(self, node: int, req: SimRequest, now: float) -> None:
        # The fetched pages and the computed ones go in together: nothing else writes to this
        # node's cache while its one prefill runs, so this equals inserting at fetch time.
        super().complete(node, req, now)
        self._publish(node)
        if self.replicator is not None:
            self.replicator.completed(now, node)

    def holders(self, keys: Chain) -> list[str]:
        """Nodes that hold all of a prefix, from its owning shard (no lookup load)."""
        if not keys:
            return []
        shard = self.index.shards[self.index.routes.owner(keys)]
        return [m.node for m in shard.lookup(keys) if m.pages >= len(keys)]

    def _publish(self, node: int) -> None:
        self.index.apply(self.publishers[node].drain_routed(self.index.routes))

    def _rebalance(self) -> None:
        if self.index.rebalance_if_uneven() is None:
            return
        self.splits += 1
        for pub in self.publishers:  # shard state is soft: resend under the new routes
            for shard, snap in pub.snapshots(self.index.routes).items():
                self.index.load_snapshot(shard, snap)

    def shard_balance(self) -> float | None:
        return self.index.load_max_over_mean()

    def index_disagreements(self, requests: Sequence[SimRequest]) -> list[int]:
        """Requests for which the index's answer differs from what the nodes' caches hold.
        Asks the owning shard directly, so that the check adds no lookup load."""
        bad = []
        for req in requests:
            if not req.keys:
                continue
            shard = self.index.shards[self.index.routes.owner(req.keys)]
            said = {m.node: m.pages for m in shard.lookup(req.keys)}
            held = {
                name: p
                for name, c in zip(self.names, self.caches)
                if (p := c.match(req.tokens, NAMESPACE).usable_pages)
            }
            if said != held:
                bad.append(req.index)
        return bad
