"""`kvfabric demo --engine reference`: the reference model's app on a cluster, each
request of multi-turn conversations sent twice, caching off and through the fabric, the
outputs compared bit for bit; the report gives hit rates by tier, bytes moved and TTFT."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from .output import send_logs_to, write_plot


def main(args: argparse.Namespace) -> int:
    # Ray and torch load only now: argument errors answer at once.
    from kvfabric.deploy.harness.cluster import connect, free_port, local_cluster, up
    from kvfabric.deploy.reference.serve.app import AppArgs

    from .trace_file import trace_of

    trace = trace_of(args)
    if trace is None:
        return 2
    # Device pools of 512 pages (8k tokens) a node: conversations outgrow them, so the
    # host tier serves too (write-back on eviction, load-back on a hit).
    app = AppArgs(max_positions=4096, device_pages=512, host_pages=8192)
    if args.address:
        connect(args.address)
    cm = local_cluster(args.nodes) if not args.address else contextlib.nullcontext()
    with cm:
        log = send_logs_to(Path(args.log))
        print(f"Ray and Serve logs: {log}", file=sys.stderr)
        print(
            f"starting the fabric and the Serve app on "
            f"{args.address or f'an embedded cluster of {args.nodes} nodes'} ...",
            file=sys.stderr,
        )
        endpoint = up(app.as_dict(), port=free_port())
        try:
            report, pairs = run(args, app, trace, endpoint)
        finally:
            if not args.address:
                from ray import serve

                serve.shutdown()
    plot = _plot(pairs, args.plot)
    print_report(report, plot)
    if args.json:
        print(json.dumps(as_json(report)))
    return 1 if report.output_mismatches or report.failed_requests else 0


def run(args: argparse.Namespace, app, trace, endpoint):
    from kvfabric.deploy.harness.http_replay import multi_turn_slice, replay, summarize
    from kvfabric.deploy.sim.trace import request_tokens

    requests = multi_turn_slice(trace, args.requests)
    cfg = app.reference_model
    limit = cfg.max_positions - args.max_tokens
    prompts = [
        request_tokens(r, args.tokens_per_block, vocab_size=cfg.vocab)[:limit] for r in requests
    ]
    print(
        f"replaying {len(prompts)} requests of multi-turn conversations "
        f"({sum(map(len, prompts))} prompt tokens), each with caching off and through the fabric",
        file=sys.stderr,
    )
    pairs = replay(
        endpoint, app.model_name, prompts, args.max_tokens, args.concurrency
    )  # no keys: one tenant
    return summarize(pairs), pairs


def _plot(pairs, where: str) -> Path | None:
    from kvfabric.deploy.harness.plots import cumulative_rate

    done = [p for p in pairs if p.baseline and p.fabric]
    rates = {
        "fabric": cumulative_rate(
            [p.fabric.cached_tokens for p in done], [p.fabric.prompt_tokens for p in done]
        ),
        "caching off": [0.0] * len(done),
    }
    ttfts = {
        "fabric": [p.fabric.ttft_ms for p in done],
        "caching off": [p.baseline.ttft_ms for p in done],
    }
    prompt = sum(p.fabric.prompt_tokens for p in done)
    hit = {
        tier: sum(getattr(p.fabric, f"{tier}_tokens") for p in done)
        for tier in ("device", "host", "remote")
    }
    tiers = {
        "fabric": {**hit, "computed": prompt - sum(hit.values())},
        "caching off": {"computed": prompt},
    }
    title = f"kvfabric demo, reference model: {len(done)} requests, the fabric vs caching off"
    return write_plot(Path(where), rates, ttfts, title, tiers)


def print_report(r, plot: Path | None) -> None:
    pct = 100 / r.prompt_tokens if r.prompt_tokens else 0.0
    print(
        f"requests {r.requests} ({r.failed_requests} failed) on {r.nodes_used} nodes; "
        f"output mismatches against caching off: {r.output_mismatches}"
    )
    print(
        f"hit rate {r.hit_rate:.1%}: device {r.device_hit_tokens * pct:.1f}%, host "
        f"{r.host_hit_tokens * pct:.1f}%, "
        f"remote {r.remote_hit_tokens * pct:.1f}% of {r.prompt_tokens} prompt tokens"
    )
    print(
        f"remote fetches {r.remote_fetches} ({r.remote_fetch_failures} rolled back), "
        f"about {r.remote_bytes / 2**20:.1f} MiB moved"
    )
    print(
        f"TTFT p50 {r.ttft_p50_ms_fabric:.1f} ms / p99 {r.ttft_p99_ms_fabric:.1f} ms with the "
        "fabric; "
        f"{r.ttft_p50_ms_nocache:.1f} / {r.ttft_p99_ms_nocache:.1f} ms with caching off "
        f"(p50 ratio {r.ttft_ratio:.2f}, target <= 0.5)"
    )
    if plot:
        print(f"plot: {plot}")


def as_json(r) -> dict:
    return {
        "name": "demo",
        "requests": r.requests,
        "failed_requests": r.failed_requests,
        "output_mismatches": r.output_mismatches,
        "prompt_tokens": r.prompt_tokens,
        "hit_rate": round(r.hit_rate, 4),
        "device_hit_tokens": r.device_hit_tokens,
        "host_hit_tokens": r.host_hit_tokens,
        "remote_hit_tokens": r.remote_hit_tokens,
        "remote_fetches": r.remote_fetches,
        "remote_bytes": r.remote_bytes,
        "ttft_p50_ms_fabric": round(r.ttft_p50_ms_fabric, 2),
        "ttft_p99_ms_fabric": round(r.ttft_p99_ms_fabric, 2),
        "ttft_p50_ms_nocache": round(r.ttft_p50_ms_nocache, 2),
        "ttft_p99_ms_nocache": round(r.ttft_p99_ms_nocache, 2),
        "ttft_ratio": round(r.ttft_ratio, 3),
        "nodes_used": r.nodes_used,
    }
