"""`kvfabric demo --rate R`: the vLLM engines under open-loop load near saturation,
mostly misses, with and without the fabric.

Single-turn requests (the trace's first requests' block text, each with a first block of
its own, so no two share a prefix and the connector saves every prompt and finds nothing
to load) arrive on a seeded Poisson schedule and each is sent at its time whatever is in
flight. Poisson, not fixed intervals: independent users arrive so, and the bursts are
what queue at an engine near saturation, where whatever the connector adds to a step
(saves in flight, admission) would show; the schedule is drawn once from the seed and is
the same for both passes.

Two passes over the same engines' set-up as the conversation demo: the stock Ray Serve
LLM app (vLLM's own prefix cache), then the fabric's (FabricConnector, FabricLLMRouter),
each after the same warm-up and the same closed-loop probe on the same prompts (salted,
so they leave nothing the measured pass can hit). Greedy outputs of the fabric's pass are
checked against the baseline's, request by request. With `--rate auto` the baseline's
probe gives its capacity, and AUTO_FRACTION of it is offered.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import sys

from kvfabric.deploy.stats import percentile

from .conversation import PassResult
from .vllm import BASELINE

AUTO = "auto"
AUTO_FRACTION = 0.9  # of the baseline's closed-loop capacity, with --rate auto
PROBE_PER_SENDER = 4  # the capacity probe's requests per sender
MAX_SENDERS = 256  # threads (connections) at most; a request finding none free is late


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s after the pass starts) of `n` requests at `rate` a second: the first
    at 0, then exponential gaps drawn from `seed`, scaled so that their mean is 1/rate
    exactly: the pass offers `rate` over its length, not only in expectation (the mean of
    59 draws strays by 13% either way). The draws do not depend on `rate`, so one seed
    gives one schedule's shape at any rate."""
    draw = random.Random(seed)
    gaps = [draw.expovariate(1.0) for _ in range(n - 1)]
    scale = len(gaps) / rate / sum(gaps) if gaps else 0.0
    return list(itertools.accumulate((g * scale for g in gaps), initial=0.0))[:n]


def steady_rate(result: PassResult, senders: int) -> float:
    """Requests a second a closed-loop pass of `senders` at once completed while every
    sender was busy: from its `senders`-th completion (the first wave started together)
    to the one that let its last request go (the drain after is left out). Over the whole
    pass when it is too short for that."""
    ends = sorted(t.done_at for t in result.done)
    first, last = senders - 1, len(ends) - senders - 1
    if last > first and ends[last] > ends[first]:
        return (last - first) / (ends[last] - ends[first])
    start = min((t.sent_at for t in result.turns if t.sent_at), default=0.0)
    return len(ends) / (ends[-1] - start) if ends and ends[-1] > start else math.nan


@dataclasses.dataclass
class LoadFigures:
    """One pass's figures. The span runs from the first send to the last completion."""

    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    span_s: float
    send_lag_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    e2e_p50_ms: float

    @classmethod
    def of(cls, result: PassResult) -> "LoadFigures":
        done = result.done
        first = min((t.sent_at for t in result.turns if t.sent_at), default=0.0)
        last = max((t.done_at for t in done), default=first)
        return cls(
            requests=len(result.turns),
            failed=result.failed,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            output_tokens=sum(len(t.token_ids) for t in done),
            span_s=last - first,
            send_lag_ms=result.send_lag_ms,
            ttft_p50_ms=result.ttft_ms(0.5),
            ttft_p99_ms=result.ttft_ms(0.99),
            tpot_p50_ms=percentile([t.tpot_ms for t in done if not math.isnan(t.tpot_ms)], 0.5),
            e2e_p50_ms=percentile([t.e2e_ms for t in done], 0.5),
        )

    @property
    def throughput(self) -> float:
        """Output tokens a second."""
        return self.output_tokens / self.span_s if self.span_s > 0 else math.nan

    @property
    def request_rate(self) -> float:
        """Completed requests a second."""
        done = self.requests - self.failed
        return done / self.span_s if self.span_s > 0 else math.nan

    def as_json(self) -> dict:
        return {
            **{k: round(v, 3) if isinstance(v, float) else v for k, v in vars(self).items()},
            "throughput_tok_s": round(self.throughput, 3),
            "request_rate": round(self.request_rate, 4),
        }

    def line(self) -> str:
        return (
            f"achieved {self.request_rate:.3f} req/s, {self.throughput:.1f} output tok/s; "
            f"TTFT p50 {self.ttft_p50_ms:.0f} / p99 {self.ttft_p99_ms:.0f} ms, TPOT p50 "
            f"{self.tpot_p50_ms:.1f} ms, end to end p50 {self.e2e_p50_ms:.0f} ms; "
            f"{self.failed} failed; cached {self.cached_tokens} of {self.prompt_tokens} prompt "
            f"tokens; sent at most {self.send_lag_ms:.0f} ms late"
        )


@dataclasses.dataclass
class LoadReport:
    nodes: int
    seed: int
    max_tokens: int
    offered_rate: float
    capacity_rate: float | None  # the baseline's closed-loop rate (--rate auto)
    probe_concurrency: int  # the requests at once it was measured with
    baseline: LoadFigures
    fabric: LoadFigures
    output_mismatches: int
    connector: dict[str, int]
    wall_s: dict[str, float]
    first_errors: dict[str, str]

    @classmethod
    def of(
        cls,
        passes: dict[str, PassResult],
        counts: dict,
        nodes: int,
        seed: int,
        max_tokens: int,
        offered_rate: float,
        capacity_rate: float | None = None,
        probe_concurrency: int = 0,
    ) -> "LoadReport":
        base, fabric = passes["baseline"].outputs(), passes["fabric"].outputs()
        return cls(
            nodes=nodes,
            seed=seed,
            max_tokens=max_tokens,
            offered_rate=offered_rate,
            capacity_rate=capacity_rate,
            probe_concurrency=probe_concurrency,
            baseline=LoadFigures.of(passes["baseline"]),
            fabric=LoadFigures.of(passes["fabric"]),
            # Over the requests both passes completed (a failure is counted as one).
            output_mismatches=sum(1 for k, v in fabric.items() if k in base and base[k] != v),
            connector={
                k: v
                for k in ("saved_requests", "stored_pages", "loaded_tokens", "save_failures")
                if isinstance(v := counts.get(k), int)
            },
            wall_s={k: round(p.wall_s, 1) for k, p in passes.items()},
            first_errors={
                k: next(t.error for t in p.turns if t.error) for k, p in passes.items() if p.failed
            },
        )

    @property
    def failed_requests(self) -> int:
        return self.baseline.failed + self.fabric.failed

    @property
    def throughput_ratio(self) -> float:
        return self.fabric.throughput / self.baseline.throughput

    @property
    def tpot_ratio(self) -> float:
        return self.fabric.tpot_p50_ms / self.baseline.tpot_p50_ms

    def print(self) -> None:
        for name, error in self.first_errors.items():
            print(f"{name}: a request failed: {error}")
        capacity = (
            f"{AUTO_FRACTION} of the baseline's closed-loop capacity, {self.capacity_rate:.3f} "
            f"req/s with {self.probe_concurrency} requests at once"
            if self.capacity_rate is not None
            else "set by --rate"
        )
        print(
            f"open loop: {self.baseline.requests} single-turn requests a pass on {self.nodes} "
            f"nodes, {self.max_tokens} tokens each, Poisson arrivals (seed {self.seed}) offered "
            f"at {self.offered_rate:.3f} req/s ({capacity})"
        )
        print(f"baseline ({BASELINE}): {self.baseline.line()}")
        print(f"fabric: {self.fabric.line()}")
        print(
            "the connectors: " + ", ".join(f"{k} {v}" for k, v in self.connector.items())
            if self.connector
            else "the connectors: no counters"
        )
        print(
            f"fabric / baseline: throughput {self.throughput_ratio:.3f} (target >= 0.95), "
            f"TPOT p50 {self.tpot_ratio:.3f} (target <= 1.05); greedy outputs differing from the "
            f"baseline's: {self.output_mismatches}; failed requests {self.failed_requests}"
        )

    def as_json(self) -> dict:
        return {
            "engine": "vllm",
            "mode": "open loop",
            "requests": self.baseline.requests,
            "nodes": self.nodes,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "offered_rate": round(self.offered_rate, 4),
            "baseline_capacity_rate": (
                None if self.capacity_rate is None else round(self.capacity_rate, 4)
            ),
            "capacity_probe_concurrency": self.probe_concurrency if self.capacity_rate else None,
            "baseline_request_rate": round(self.baseline.request_rate, 4),
            "fabric_request_rate": round(self.fabric.request_rate, 4),
            "throughput_ratio_vs_baseline": round(self.throughput_ratio, 4),
            "tpot_p50_ratio_vs_baseline": round(self.tpot_ratio, 4),
            "output_mismatches": self.output_mismatches,
            "failed_requests": self.failed_requests,
            "baseline_name": BASELINE,
            "baseline": self.baseline.as_json(),
            "fabric": self.fabric.as_json(),
            "connector": self.connector,
            "wall_s": self.wall_s,
        }


@dataclasses.dataclass
class LoadRun:
    passes: dict[str, PassResult]
    counts: dict
    offered_rate: float
    capacity_rate: float | None


def main(args: argparse.Namespace) -> int:
    from .conversation import single_turn_texts
    from .trace_file import trace_of
    from .vllm import engines, max_prompt_chars, on_cluster

    trace = trace_of(args)
    if trace is None:
        return 2
    prompts = single_turn_texts(
        trace[: args.requests], args.tokens_per_block, max_prompt_chars(args)
    )

    def run(app) -> LoadRun:
        print(
            f"{len(prompts)} single-turn requests ({sum(map(len, prompts))} prompt tokens, no "
            f"two sharing a prefix), {engines(app, args)}",
            file=sys.stderr,
        )
        return run_load(app, prompts, args)

    reserve_as_the_stock_engine()
    done, nodes = on_cluster(args, run)
    report = LoadReport.of(
        done.passes,
        done.counts,
        nodes,
        args.seed,
        args.max_tokens,
        done.offered_rate,
        done.capacity_rate,
        args.concurrency,
    )
    report.print()
    if args.json:
        print(json.dumps(report.as_json()))
    return 1 if report.output_mismatches or report.failed_requests else 0


def reserve_as_the_stock_engine() -> None:
    """Both passes' CPU engines bind the same cores. vLLM's CPU executor reserves a core
    a rank, and one more for an engine with a KV connector; with no core to spare it binds
    every core instead (on a 2-core host the stock engine's forward ran on core 0, the
    fabric's on cores 0 and 1). Set before the demo's cluster starts, every engine
    inherits what an engine without a connector reserves; the fabric's copy thread runs on
    the reserved core (deploy/vllm/connector/copy_cores.py). A value the user set stays."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")


def run_load(app, prompts: list[str], args: argparse.Namespace) -> LoadRun:
    from kvfabric.deploy.harness.cluster import free_port

    from .conversation import replay_conversations
    from .vllm import counted, start_baseline, start_fabric

    port = free_port()
    single = [[p] for p in prompts]

    def go(name: str, endpoint, rate: float) -> PassResult:
        arrivals = poisson_arrivals(len(prompts), rate, args.seed)
        senders = min(len(prompts), MAX_SENDERS)
        return replay_conversations(
            name, endpoint, app.model_id, single, args.max_tokens, senders, arrivals=arrivals
        )

    def probe(name: str, endpoint) -> PassResult:
        """Closed-loop requests over the prompts (so their lengths are the measured
        pass's), uncached (salted: they leave nothing the measured pass can hit). Each pass
        runs one on its fresh engines before it is measured, so both meet engines as warm:
        the baseline's capacity probe warmed its engines, where the fabric's had only the
        short warm-up (with this probe too, the TPOT gap stayed: docs/internals.md)."""
        m = min(len(prompts), PROBE_PER_SENDER * args.concurrency)
        result = replay_conversations(
            name,
            endpoint,
            app.model_id,
            [single[i * len(prompts) // m] for i in range(m)],
            args.max_tokens,
            args.concurrency,
            uncached=True,
        )
        if result.failed:
            print(f"  {result.failed} {name} requests failed", file=sys.stderr)
        return result

    endpoint = start_baseline(app, port)
    capacity = None
    probed = probe("capacity", endpoint)
    if args.rate == AUTO:
        capacity = steady_rate(probed, args.concurrency)
        print(
            f"  the baseline's capacity: {capacity:.3f} req/s, {args.concurrency} at once; "
            f"offering {AUTO_FRACTION} of it",
            file=sys.stderr,
        )
        if not capacity > 0:
            raise RuntimeError("the capacity probe completed no requests")
    rate = AUTO_FRACTION * capacity if capacity is not None else float(args.rate)
    passes = {"baseline": go("baseline", endpoint, rate)}
    endpoint, warmups = start_fabric(app, port)
    warmups += len(probe("warm-up", endpoint).turns)
    passes["fabric"], counts = counted(app, warmups, lambda: go("fabric", endpoint, rate))
    return LoadRun(passes, counts, rate, capacity)
