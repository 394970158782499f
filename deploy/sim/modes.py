"""The simulated cluster each replay mode runs: its own routing over per-node caches
(pow2, affinity), the fabric's global index (global), or one shared cache (pooled, and
the unbounded ideal)."""

from __future__ import annotations

import random
from typing import Sequence

from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.deploy.placement import PowerOfTwo, PrefixAffinity

from .cluster import Cluster, Mode, SharedCluster, SimConfig, SimRequest, fabric_score
from .global_mode import FabricCluster


def make_cluster(mode: Mode, config: SimConfig, requests: Sequence[SimRequest]) -> Cluster:
    rng = random.Random(config.seed)
    if mode is Mode.POW2:
        return Cluster(config, PowerOfTwo(rng))
    if mode is Mode.AFFINITY:
        return Cluster(
            config, PrefixAffinity(rng, config.match_rate_threshold, config.imbalanced_threshold)
        )
    if mode is Mode.GLOBAL:
        return FabricCluster(config, fabric_score(config))
    n, tiers = config.nodes, config.tier_pages
    pages = (
        PoolCapacity(n * tiers.device, n * tiers.host, n * tiers.disk)
        if mode is Mode.POOLED
        else PoolCapacity(sum(r.pages for r in requests))
    )
    return SharedCluster(config, fabric_score(config), pages)
