"""`kvfabric replay`: a cluster-scale trace replay on the real `fabric/` core, in simulated time.

Requests arrive at their trace timestamps. Each of N nodes serves one prefill at a time from a
FIFO queue; a request's TTFT is its queue wait, plus a remote fetch if it makes one, plus the
prefill of what it did not find cached, plus a per-request overhead. Three modes run on the same
trace: `local` (node-local caches, cache-aware routing), `global` (the fabric: sharded index and
remote fetch) and `infinite` (one unbounded cache: the ceiling). See `deploy.sim_cluster`.
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

from .sim_cluster import GlobalPolicy, Mode, Policy, SimConfig, SimRequest, make_policy, prepare

# Capacity points of `--plot`, as multiples of --capacity-tokens.
PLOT_FACTORS = (0.25, 0.5, 1.0, 2.0)
MOONCAKE_GLOBAL_OVER_LOCAL = {"conversation": 2.22, "synthetic": 2.36}
INDEX_CHECK_SAMPLES = 200

Progress = Callable[[int], None]        # called with requests done so far in the current run


@dataclass
class ModeResult:
    mode: Mode
    capacity_tokens: int
    prompt_tokens: int = 0
    hit_tokens: int = 0
    remote_hit_tokens: int = 0              # of hit_tokens, fetched from another node
    prefill_tokens: int = 0
    bytes_moved: int = 0
    fetches: int = 0
    ttft_s: list[float] = field(default_factory=list)
    shard_balance: float | None = None
    index_checked: int = 0
    index_disagreements: int = 0
    elapsed_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def ttft_ms(self, q: float) -> float:
        """Nearest-rank percentile of TTFT, in ms."""
        if not self.ttft_s:
            return 0.0
        ordered = sorted(self.ttft_s)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1e3

    def to_json(self) -> dict:
        out = {"hit_rate": round(self.hit_rate, 4), "prefill_tokens": self.prefill_tokens,
               "ttft_p50_ms": round(self.ttft_ms(0.5), 1), "ttft_p99_ms": round(self.ttft_ms(0.99), 1),
               "hit_tokens": self.hit_tokens, "bytes_moved": self.bytes_moved}
        if self.mode is Mode.GLOBAL:
            out.update(remote_hit_tokens=self.remote_hit_tokens, fetches=self.fetches,
                       shard_load_max_over_mean=_round(self.shard_balance),
                       index_checked=self.index_checked, index_disagreements=self.index_disagreements)
        return out


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def simulate(policy: Policy, requests: Sequence[SimRequest], progress: Progress | None = None) -> ModeResult:
    """Replay `requests` (in arrival order) through `policy`'s cluster; discrete events."""
    n = policy.config.nodes
    queues: list[deque[tuple[SimRequest, float]]] = [deque() for _ in range(n)]
    busy, loads = [False] * n, [0] * n
    run_end, queued_s = [0.0] * n, [0.0] * n     # the router's backlog view
    done: list[tuple] = []                  # (end time, tie-break, node, request, service)
    order = itertools.count()
    res = ModeResult(policy.mode, policy.config.capacity_tokens)
    t0 = time.perf_counter()

    def start(i: int, now: float) -> None:
        req, estimate = queues[i].popleft()
        queued_s[i] = queued_s[i] - estimate if queues[i] else 0.0
        svc = policy.serve(i, req)
        run_end[i] = now + svc.duration_s
        heapq.heappush(done, (run_end[i], next(order), i, req, svc))
        busy[i] = True

    def finish_until(t: float) -> None:
        while done and done[0][0] <= t:
            now, _, i, req, svc = heapq.heappop(done)
            policy.complete(i, req)
            loads[i] -= 1
            busy[i] = False
            res.prompt_tokens += req.input_length
            res.hit_tokens += svc.hit_tokens
            res.remote_hit_tokens += svc.hit_tokens - svc.local_tokens
            res.prefill_tokens += svc.prefill_tokens
            res.bytes_moved += svc.fetched_bytes
            res.fetches += svc.fetched_bytes > 0
            res.ttft_s.append(now - req.arrival_s)
            if queues[i]:
                start(i, now)

    for k, req in enumerate(requests):
        finish_until(req.arrival_s)
        now = req.arrival_s
        placed = policy.route(req, loads, [max(0.0, run_end[j] - now) + queued_s[j] for j in range(n)])
        i = placed.node
        queues[i].append((req, placed.estimate_s))
        queued_s[i] += placed.estimate_s
        loads[i] += 1
        if not busy[i]:
            start(i, req.arrival_s)
        if progress is not None:
            progress(k + 1)
    finish_until(math.inf)
    res.shard_balance = policy.shard_balance()
    if isinstance(policy, GlobalPolicy):
        step = max(1, len(requests) // INDEX_CHECK_SAMPLES)
        sample = requests[::step]
        res.index_checked = len(sample)
        res.index_disagreements = len(policy.index_disagreements(sample))
    res.elapsed_s = time.perf_counter() - t0
    return res


def run_mode(mode: Mode, config: SimConfig, requests: Sequence[SimRequest],
             progress: Progress | None = None) -> ModeResult:
    return simulate(make_policy(mode, config, requests), requests, progress)


@dataclass
class Replay:
    config: SimConfig
    requests: int
    main: dict[Mode, ModeResult]
    sweep: list[ModeResult]                 # every run, the main ones included
    elapsed_s: float

    def ratio(self, a: Mode, b: Mode) -> float | None:
        hb = self.main[b].hit_rate
        return self.main[a].hit_rate / hb if hb else None

    def to_json(self) -> dict:
        return {"requests": self.requests, "nodes": self.config.nodes,
                "capacity_tokens": self.config.capacity_tokens, "shards": self.config.shards,
                "modes": {m.value: r.to_json() for m, r in self.main.items()},
                "global_over_local_hit_rate": _round(self.ratio(Mode.GLOBAL, Mode.LOCAL)),
                "global_over_infinite_hit_rate": _round(self.ratio(Mode.GLOBAL, Mode.INFINITE)),
                "shard_load_max_over_mean": _round(self.main[Mode.GLOBAL].shard_balance),
                "mooncake_global_over_local_hit_rate": MOONCAKE_GLOBAL_OVER_LOCAL,
                "sweep": [{"mode": r.mode.value, "capacity_tokens": r.capacity_tokens,
                           "hit_rate": round(r.hit_rate, 4)} for r in self.sweep],
                "elapsed_s": round(self.elapsed_s, 1)}


def replay(config: SimConfig, requests: Sequence[SimRequest], factors: Sequence[float] = (1.0,),
           bar: "Bar | None" = None) -> Replay:
    """Every mode at `config`'s capacity, and local and global at each other capacity factor."""
    t0 = time.perf_counter()
    plan = [(Mode.INFINITE, config)]        # capacity-independent: run once
    for f in sorted(set(factors) | {1.0}):
        c = config if f == 1.0 else _scaled(config, f)
        plan += [(Mode.LOCAL, c), (Mode.GLOBAL, c)]
    runs, main = [], {}
    for k, (mode, c) in enumerate(plan):
        label = f"[{k + 1}/{len(plan)}] {mode.value} @ {c.capacity_tokens:,} tokens/node"
        runs.append(run_mode(mode, c, requests, bar.for_run(label) if bar else None))
        if c is config:
            main[mode] = runs[-1]
    if bar:
        bar.close()
    main = {m: main[m] for m in (Mode.LOCAL, Mode.GLOBAL, Mode.INFINITE)}
    return Replay(config, len(requests), main, runs, time.perf_counter() - t0)


def _scaled(config: SimConfig, factor: float) -> SimConfig:
    return dataclasses.replace(config, capacity_tokens=max(512, int(config.capacity_tokens * factor)))


class Bar:
    """A one-line progress bar on stderr, redrawn at most a few times a second."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.width = max(total, 1), width
        self.stream = sys.stderr if stream is None else stream
        self._last = 0.0

    def for_run(self, label: str) -> Progress:
        def update(done: int) -> None:
            now = time.monotonic()
            if done != self.total and now - self._last < 0.25:
                return
            self._last = now
            filled = self.width * done // self.total
            self.stream.write(f"\r{label} [{'#' * filled}{'.' * (self.width - filled)}] "
                              f"{done}/{self.total}\033[K")
            self.stream.flush()
        return update

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def main(argv: list[str] | None = None) -> int:
    from .sim_report import parse_args, print_table, write_plot
    from .trace import TraceError, load_trace
    args, config = parse_args(argv)
    try:
        trace = load_trace(args.trace, limit=args.requests)
    except (TraceError, OSError, ValueError) as e:
        print(f"kvfabric replay: error: {e}", file=sys.stderr)
        return 2
    if not trace:
        print(f"kvfabric replay: error: the trace {args.trace or 'packaged'} has no requests", file=sys.stderr)
        return 2
    requests = prepare(trace, config)
    factors = PLOT_FACTORS if args.plot else (1.0,)
    bar = None if args.no_progress else Bar(len(requests))
    result = replay(config, requests, factors, bar)
    print_table(result, args.trace)
    if args.plot:
        print(f"plot: {write_plot(result, Path(args.plot))}")
    if args.json:
        import json
        print(json.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
