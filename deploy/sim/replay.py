"""`kvfabric replay`: a cluster-scale trace replay on the real `core/` core, in simulated time.

Requests arrive at their trace timestamps and are routed as Ray Serve would, seeing each
replica's queue length (requests queued or running there). Each of N nodes runs one prefill
at a time from a FIFO queue; a request's TTFT is its queue wait, plus a remote fetch if it
makes one, plus reading up what it found on its node's host or disk tier (`--host-tokens`,
`--disk-tokens`: pages the device evicts go down a tier), plus the prefill of what it did
not find cached, plus a per-request overhead.
It then decodes its output (output_length x the time per output token, batched beside the
node's other work) and leaves the node's queue. Five modes run on the same trace at each
capacity: `pow2`, `affinity` (what Ray Serve ships), `global` (the fabric as deployed),
`pooled` and `infinite` (the limits). See `kvfabric.deploy.sim.cluster`.

`global` copies hot prefixes to more nodes ahead of demand (`--no-replicate` turns it
off); it then also runs with replication off, and the two are compared: remote fetches
and TTFT p50/p99 (`kvfabric.deploy.sim.replication`).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence, TextIO

from kvfabric.deploy.stats import percentile
from tqdm import tqdm

from .cluster import Cluster, Mode, SimConfig, SimRequest, prepare
from .modes import make_cluster
from .replication import ReplicaStats

INDEX_CHECK_SAMPLES = 200

Progress = Callable[[int], None]  # called with requests done so far in the current run


@dataclass
class ModeResult:
    mode: Mode
    capacity_tokens: int
    prompt_tokens: int = 0
    hit_tokens: int = 0
    remote_hit_tokens: int = 0  # of hit_tokens, fetched from another node
    host_hit_tokens: int = 0  # of hit_tokens, read up from the node's own host tier
    disk_hit_tokens: int = 0  # and from its own disk tier
    tiered: bool = False  # the nodes had tiers below the device: the report splits hits by tier
    prefill_tokens: int = 0
    bytes_moved: int = 0
    fetches: int = 0
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)  # arrival to the last output token
    shard_balance: float | None = None
    index_checked: int = 0
    index_disagreements: int = 0
    replicas: ReplicaStats | None = None  # global with replication on
    elapsed_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def hits_by_tier(self) -> dict[str, int]:
        """Hit tokens by where they came from: the node's own tiers, or another node."""
        local = self.hit_tokens - self.remote_hit_tokens
        return {
            "device": local - self.host_hit_tokens - self.disk_hit_tokens,
            "host": self.host_hit_tokens,
            "disk": self.disk_hit_tokens,
            "remote": self.remote_hit_tokens,
        }

    def ttft_ms(self, q: float) -> float:
        return percentile(self.ttft_s, q) * 1e3

    def e2e_ms(self, q: float) -> float:
        return percentile(self.e2e_s, q) * 1e3

    def to_json(self) -> dict:
        out: dict[str, object] = {
            "hit_rate": round(self.hit_rate, 4),
            "prefill_tokens": self.prefill_tokens,
            "ttft_p50_ms": round(self.ttft_ms(0.5), 1),
            "ttft_p99_ms": round(self.ttft_ms(0.99), 1),
            "e2e_p50_ms": round(self.e2e_ms(0.5), 1),
            "hit_tokens": self.hit_tokens,
            "bytes_moved": self.bytes_moved,
        }
        if self.tiered:
            out["hit_tokens_by_tier"] = self.hits_by_tier()
        if self.mode is Mode.GLOBAL:
            out.update(
                remote_hit_tokens=self.remote_hit_tokens,
                fetches=self.fetches,
                shard_load_max_over_mean=_round(self.shard_balance),
                index_checked=self.index_checked,
                index_disagreements=self.index_disagreements,
            )
        if self.replicas is not None:
            out["replicas"] = dataclasses.asdict(self.replicas)
        return out


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def simulate(
    cluster: Cluster, requests: Sequence[SimRequest], mode: Mode, progress: Progress | None = None
) -> ModeResult:
    """Replay `requests` (in arrival order) through `cluster`; discrete events."""
    n, c = cluster.config.nodes, cluster.config
    queues: list[deque[SimRequest]] = [deque() for _ in range(n)]
    busy, loads = [False] * n, [0] * n
    events: list[tuple] = []  # (time, tie-break, node, request, service or None)
    order = itertools.count()
    res = ModeResult(mode, c.capacity_tokens, tiered=c.host_tokens > 0)
    t0 = time.perf_counter()

    def start(i: int, now: float) -> None:
        req = queues[i].popleft()
        svc = cluster.serve(i, req, now)
        heapq.heappush(events, (now + svc.duration_s, next(order), i, req, svc))
        busy[i] = True

    def advance(t: float) -> None:
        while events and events[0][0] <= t:
            now, _, i, req, svc = heapq.heappop(events)
            if svc is None:  # its decode ended: it leaves the node's queue
                loads[i] -= 1
                res.e2e_s.append(now - req.arrival_s)
                continue
            cluster.complete(i, req, now)
            busy[i] = False
            res.prompt_tokens += req.input_length
            res.hit_tokens += svc.hit_tokens
            res.remote_hit_tokens += svc.hit_tokens - svc.local_tokens
            res.host_hit_tokens += svc.host_tokens
            res.disk_hit_tokens += svc.disk_tokens
            res.prefill_tokens += svc.prefill_tokens
            res.bytes_moved += svc.fetched_bytes
            res.fetches += svc.fetched_bytes > 0
            res.ttft_s.append(now - req.arrival_s)
            heapq.heappush(
                events, (now + req.output_length * c.decode_s_per_token, next(order), i, req, None)
            )
            if queues[i]:
                start(i, now)

    for k, req in enumerate(requests):
        advance(req.arrival_s)
        i = cluster.route(req, loads)
        queues[i].append(req)
        loads[i] += 1
        if not busy[i]:
            start(i, req.arrival_s)
        if progress is not None:
            progress(k + 1)
    advance(math.inf)
    res.shard_balance = cluster.shard_balance()
    replicator = getattr(cluster, "replicator", None)
    if replicator is not None:
        res.replicas = replicator.stats
    check = getattr(cluster, "index_disagreements", None)
    if check is not None:
        sample = requests[:: max(1, len(requests) // INDEX_CHECK_SAMPLES)]
        res.index_checked = len(sample)
        res.index_disagreements = len(check(sample))
    res.elapsed_s = time.perf_counter() - t0
    return res


def run_mode(
    mode: Mode, config: SimConfig, requests: Sequence[SimRequest], progress: Progress | None = None
) -> ModeResult:
    return simulate(make_cluster(mode, config, requests), requests, mode, progress)


RATIOS = (Mode.POW2, Mode.AFFINITY, Mode.POOLED, Mode.INFINITE)  # global over each


@dataclass
class Point:
    """Every mode at one capacity per node."""

    capacity_tokens: int
    modes: dict[Mode, ModeResult]
    unreplicated: ModeResult | None = None  # global again with replication off, if it was on

    def replication(self) -> dict | None:
        """Global with replication on against off: remote fetches and TTFT."""
        on, off = self.modes.get(Mode.GLOBAL), self.unreplicated
        if on is None or off is None:
            return None

        def figures(r: ModeResult) -> dict:
            return {
                "fetches": r.fetches,
                "hit_rate": round(r.hit_rate, 4),
                "ttft_p50_ms": round(r.ttft_ms(0.5), 1),
                "ttft_p99_ms": round(r.ttft_ms(0.99), 1),
            }

        def over(a: float, b: float) -> float | None:
            return _round(a / b) if b else None

        return {
            "on": figures(on),
            "off": figures(off),
            "fetches_on_over_off": over(on.fetches, off.fetches),
            "ttft_p50_on_over_off": over(on.ttft_ms(0.5), off.ttft_ms(0.5)),
            "ttft_p99_on_over_off": over(on.ttft_ms(0.99), off.ttft_ms(0.99)),
        }

    def ratio(self, a: Mode, b: Mode) -> float | None:
        """Hit rate of `a` over `b`; None when either did not run or `b` hit nothing."""
        if a not in self.modes or b not in self.modes or not self.modes[b].hit_rate:
            return None
        return self.modes[a].hit_rate / self.modes[b].hit_rate

    def ttft_ratio(self, a: Mode, b: Mode) -> float | None:
        """TTFT p50 of `a` over `b` (below 1: `a` is faster)."""
        if a not in self.modes or b not in self.modes or not self.modes[b].ttft_ms(0.5):
            return None
        return self.modes[a].ttft_ms(0.5) / self.modes[b].ttft_ms(0.5)

    def to_json(self) -> dict:
        out: dict = {
            "capacity_tokens": self.capacity_tokens,
            "modes": {m.value: r.to_json() for m, r in self.modes.items()},
        }
        for b in RATIOS:
            out[f"global_over_{b.value}_hit_rate"] = _round(self.ratio(Mode.GLOBAL, b))
        for b in (Mode.POW2, Mode.AFFINITY):
            out[f"global_over_{b.value}_ttft_p50"] = _round(self.ttft_ratio(Mode.GLOBAL, b))
        g = self.modes.get(Mode.GLOBAL)
        out["shard_load_max_over_mean"] = _round(g.shard_balance) if g else None
        if (rep := self.replication()) is not None:
            out["replication"] = rep
        return out


@dataclass
class Replay:
    config: SimConfig
    requests: int
    points: list[Point]  # one per capacity, in the order asked
    elapsed_s: float

    def to_json(self) -> dict:
        """The first capacity's figures at the top, every capacity's in `sweep`;
        `shard_load_max_over_mean` is the worst global run's."""
        first = self.points[0].to_json()
        balances = [
            b
            for p in self.points
            if Mode.GLOBAL in p.modes and (b := p.modes[Mode.GLOBAL].shard_balance) is not None
        ]
        return {
            "requests": self.requests,
            "nodes": self.config.nodes,
            "shards": self.config.shards,
            **first,
            "shard_load_max_over_mean": _round(max(balances)) if balances else None,
            "sweep": [p.to_json() for p in self.points],
            "elapsed_s": round(self.elapsed_s, 1),
        }


def replay(
    config: SimConfig,
    requests: Sequence[SimRequest],
    capacities: Sequence[int] = (),
    modes: Sequence[Mode] = tuple(Mode),
    bar: "Bar | None" = None,
) -> Replay:
    """Every mode at each capacity (default: the config's). The infinite cache does not
    depend on capacity: it runs once."""
    t0 = time.perf_counter()
    points, infinite = [], None
    for cap in capacities or (config.capacity_tokens,):
        cfg = dataclasses.replace(config, capacity_tokens=cap)
        results: dict[Mode, ModeResult] = {}
        for mode in modes:
            if mode is Mode.INFINITE and infinite is not None:
                results[mode] = dataclasses.replace(infinite, capacity_tokens=cap)
                continue
            label = f"{mode.value:<8} {cap:>10,}"
            results[mode] = run_mode(mode, cfg, requests, bar.for_run(label) if bar else None)
            if mode is Mode.INFINITE:
                infinite = results[mode]
        unreplicated = None
        if Mode.GLOBAL in results and cfg.replication.enabled:
            off = dataclasses.replace(
                cfg, replication=dataclasses.replace(cfg.replication, enabled=False)
            )
            label = f"{'global-':<8} {cap:>10,}"  # global, replication off
            unreplicated = run_mode(Mode.GLOBAL, off, requests, bar.for_run(label) if bar else None)
        points.append(Point(cap, results, unreplicated))
    if bar:
        bar.close()
    return Replay(config, len(requests), points, time.perf_counter() - t0)


class Bar:
    """A progress bar on stderr per run (tqdm: redrawn a few times a second on a terminal,
    off when stderr is a file or a pipe)."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.stream = sys.stderr if stream is None else stream
        self._bar: tqdm | None = None

    def for_run(self, label: str) -> Progress:
        self.close()
        bar = self._bar = tqdm(
            total=self.total, desc=label, file=self.stream, mininterval=0.25, disable=None
        )

        def update(done: int) -> None:
            bar.update(done - bar.n)

        return update

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def main(argv: list[str] | None = None) -> int:
    from .report import parse_args, print_table, write_plot
    from .trace import TraceError, load_trace

    args, config = parse_args(argv, __doc__)
    try:
        trace = load_trace(args.trace, limit=args.requests)
    except (TraceError, OSError, ValueError) as e:
        print(f"kvfabric replay: error: {e}", file=sys.stderr)
        return 2
    if not trace:
        print(
            f"kvfabric replay: error: the trace {args.trace or 'packaged'} has no requests",
            file=sys.stderr,
        )
        return 2
    requests = prepare(trace, config)
    bar = None if args.no_progress else Bar(len(requests))
    result = replay(config, requests, args.capacity_tokens, args.modes, bar)
    print_table(result, args.trace)
    if args.plot:
        print(f"plot: {write_plot(result, Path(args.plot))}")
    if args.json:
        import json

        print(json.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
