"""`kvfabric status`: what every fabric on the connected cluster holds, for an operator:
its nodes, each pool's fill by tier, lookups and hit rates, stored and evicted pages, the
engines it stages for, and the models served from it. Read from the fabrics' own actors
(the directory, each node actor), each call bounded; a node that does not answer is
listed as unreachable, not waited for."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

from kvfabric.actors.names import CALL_TIMEOUT_S, DIRECTORY, NAMESPACE


@dataclass(frozen=True)
class PoolFill:
    pool: str  # "full" or "swa"
    tier: str  # "device" or "host"
    used: int
    capacity: int


@dataclass(frozen=True)
class NodeStatus:
    name: str
    reachable: bool
    pools: tuple[PoolFill, ...] = ()
    lookups: int = 0
    lookup_pages: int = 0
    hit_pages_device: int = 0
    hit_pages_host: int = 0
    inserted_pages: int = 0
    evicted_pages: int = 0
    fetched_bytes: int = 0
    engines: int = 0  # engines whose staging pages it maps

    @property
    def hit_rate(self) -> float:
        """Pages served over pages looked up (0 before any lookup)."""
        hits = self.hit_pages_device + self.hit_pages_host
        return hits / self.lookup_pages if self.lookup_pages else 0.0


@dataclass(frozen=True)
class FabricStatus:
    namespace: str
    models: tuple[str, ...]
    nodes: tuple[NodeStatus, ...] = field(default=())


def fabric_status(timeout_s: float = CALL_TIMEOUT_S) -> list[FabricStatus]:
    """Every fabric on the connected cluster (the default one's and each KV identity's)."""
    import ray

    spaces = sorted(
        {
            a["namespace"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"] == DIRECTORY
            and (a["namespace"] == NAMESPACE or a["namespace"].startswith(NAMESPACE + "."))
        }
    )
    models = _models()
    return [
        FabricStatus(ns, tuple(sorted(models.get(ns, ()))), _nodes(ns, timeout_s)) for ns in spaces
    ]


def _models() -> dict[str, set[str]]:
    """Fabric namespace -> the models whose engines announced it (actors/served.py)."""
    from kvfabric.actors.served import announced

    out: dict[str, set[str]] = {}
    for model, namespace in announced():
        out.setdefault(namespace, set()).add(model)
    return out


def _nodes(namespace: str, timeout_s: float) -> tuple[NodeStatus, ...]:
    import ray
    from ray.exceptions import RayError

    try:
        directory = ray.get_actor(DIRECTORY, namespace=namespace)
        names: list[str] = sorted(ray.get(directory.node_names.remote(), timeout=timeout_s))
    except (ValueError, RayError):
        return ()
    out = []
    for name in names:
        node = None
        with contextlib.suppress(ValueError, RayError):
            actor = ray.get_actor(name, namespace=namespace)
            stats, cache = ray.get(
                [actor.stats.remote(), actor.cache_stats.remote()], timeout=timeout_s
            )
            node = NodeStatus(
                name,
                True,
                tuple(
                    PoolFill(*key.lower().split("/"), p["used"], p["capacity"])
                    for key, p in sorted(stats["pools"].items())
                ),
                cache.lookups,
                cache.lookup_pages,
                cache.hit_pages_device,
                cache.hit_pages_host,
                cache.inserted_pages,
                cache.evicted_pages,
                stats["fetched_bytes"],
                stats["staging_engines"],
            )
        out.append(node or NodeStatus(name, False))
    return tuple(out)


def as_json(fabrics: list[FabricStatus]) -> list[dict]:
    return [
        dataclasses.asdict(f)
        | {"nodes": [dataclasses.asdict(n) | {"hit_rate": round(n.hit_rate, 4)} for n in f.nodes]}
        for f in fabrics
    ]


def render(fabrics: list[FabricStatus]) -> str:
    """A table per fabric, one row per node."""
    if not fabrics:
        return "no fabric runs on this cluster (kvfabric up starts one)"
    lines = []
    for f in fabrics:
        models = ", ".join(f.models) or "none announced"
        lines.append(f"fabric {f.namespace}: {len(f.nodes)} nodes; models: {models}")
        pools = sorted({(p.pool, p.tier) for n in f.nodes for p in n.pools})
        head = ["node", *(f"{p}/{t}" for p, t in pools), "lookups", "hit rate", "stored"]
        rows = [[*head, "evicted", "fetched MiB", "engines"]]
        for n in f.nodes:
            if not n.reachable:
                rows.append([n.name, "unreachable"])
                continue
            fill = {(p.pool, p.tier): p for p in n.pools}
            rows.append(
                [
                    n.name,
                    *(f"{fill[k].used}/{fill[k].capacity}" if k in fill else "-" for k in pools),
                    str(n.lookups),
                    f"{n.hit_rate:.1%}",
                    str(n.inserted_pages),
                    str(n.evicted_pages),
                    f"{n.fetched_bytes / 2**20:.1f}",
                    str(n.engines),
                ]
            )
        widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(rows[0]))]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)
