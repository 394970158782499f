"""`kvfabric demo`: the fabric and its Serve app on a cluster, fed multi-turn
conversations of a real trace through the OpenAI endpoint.

With no address it starts an embedded local Ray cluster of simulated nodes on this
machine; with `--address` (or RAY_ADDRESS) it uses that cluster.
- `--engine vllm` (default): vLLM engines under Ray Serve LLM, first as users run them
  today (vLLM's prefix cache, Ray's PrefixCacheAffinityRouter), then with the fabric as
  their KV layer; outputs are checked against a pass with caching off (deploy/vllm/demo.py).
  With `--rate R` (or `--rate auto`): open-loop load instead, single-turn requests that
  share no prefix arriving at R a second, the stock app against the fabric's; the report
  gives throughput and TPOT ratios (deploy/vllm/load_demo.py).
- `--engine reference`: the reference model's app; each request is sent twice, caching
  off and through the fabric, outputs compared bit for bit.
The report gives hit rates by tier, bytes moved, TTFT and output mismatches; a PNG too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from .cluster import keep_auth_on

DEFAULT_PLOT = "kvfabric-demo.png"
DEFAULT_LOG = "kvfabric-demo.log"


# Per engine: (nodes, requests, tokens per trace block, max tokens, concurrency).
DEFAULTS = {"reference": (3, 120, 64, 4, 3), "vllm": (2, 60, 32, 8, 6)}
# Tokens a request under --rate: enough decode steps that TPOT is a median of many.
LOAD_MAX_TOKENS = 32


def rate(text: str) -> float | str:
    """--rate's value: requests a second (> 0), or "auto"."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or auto: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be positive and finite: {text!r}")
    return value


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="kvfabric demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--engine",
        choices=tuple(DEFAULTS),
        default="vllm",
        help="vllm: vLLM under Ray Serve LLM against the stock set-up (default); "
        "reference: the bit-exact reference model against caching off",
    )
    ap.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS"),
        help="an existing Ray cluster (default: RAY_ADDRESS, else an embedded one)",
    )
    ap.add_argument(
        "--nodes", type=int, help="simulated nodes of the embedded cluster (vllm 2, reference 3)"
    )
    ap.add_argument(
        "--trace", default=None, help="a Mooncake-format JSONL trace (default: the packaged one)"
    )
    ap.add_argument("--requests", type=int, help="requests a pass (vllm 60, reference 120)")
    ap.add_argument(
        "--tokens-per-block",
        type=int,
        help="prompt tokens per trace hash block (the trace's are 512; vllm 32, reference 64)",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        help=f"tokens generated a request (vllm 8, with --rate {LOAD_MAX_TOKENS}; reference 4)",
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        help="requests (vllm: conversations) at once (vllm 6, reference 3); with --rate auto, "
        "the capacity probe's",
    )
    ap.add_argument(
        "--rate",
        type=rate,
        help="vllm: open-loop load of single-turn requests sharing no prefix, this many a "
        "second (Poisson arrivals), the stock app against the fabric's; auto: 0.9 of the "
        "stock app's capacity, measured first closed loop",
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="with --rate: the arrival schedule's seed (0)"
    )
    ap.add_argument(
        "--kv-cache-mib",
        type=int,
        default=17,
        help="vllm: each engine's own KV cache (17: about 2,000 tokens, one max-length prompt)",
    )
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="vllm: engines on CUDA, every simulated node given this machine's GPU 0 "
        "(they share it; each engine may take 0.8/nodes of its memory)",
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="vllm: each engine's tensor-parallel ranks (on CPU one core each)",
    )
    ap.add_argument("--plot", default=DEFAULT_PLOT, help="where to write the PNG (not with --rate)")
    ap.add_argument(
        "--log",
        default=DEFAULT_LOG,
        help="where Ray's, Serve's and vLLM's log lines go (the console keeps the demo's own)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args(argv)
    if args.rate is not None and args.engine != "vllm":
        ap.error("--rate is for the vllm engine")
    if args.rate is not None and args.max_tokens is None:
        args.max_tokens = LOAD_MAX_TOKENS
    names = ("nodes", "requests", "tokens_per_block", "max_tokens", "concurrency")
    for name, default in zip(names, DEFAULTS[args.engine]):
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in names + ("kv_cache_mib", "tp"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.gpu and (args.engine != "vllm" or args.address):
        ap.error("--gpu is for the vllm engine on the embedded cluster")
    if args.tp > 1 and args.engine != "vllm":
        ap.error("--tp is for the vllm engine")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.address:
        keep_auth_on()
    if args.engine == "vllm":
        from kvfabric.deploy.vllm.demo import main as vllm_demo

        return vllm_demo(args)
    # Ray and torch load only now: argument errors answer at once.
    from kvfabric.deploy.serve.app import AppArgs
    from kvfabric.deploy.sim.trace import TraceError, load_trace

    from .cluster import connect, free_port, local_cluster, up

    try:
        trace = load_trace(args.trace)
    except (TraceError, OSError) as e:
        print(f"kvfabric demo: {e}", file=sys.stderr)
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
    from kvfabric.deploy.sim.trace import request_tokens

    from .http_replay import multi_turn_slice, replay, summarize

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
    from .plots import cumulative_rate

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


def write_plot(
    where: Path, rates: dict, ttfts: dict, title: str = "", tiers: dict | None = None
) -> Path | None:
    from .plots import write_png

    try:
        return write_png(where, rates, ttfts, title, tiers).resolve()
    except OSError as e:
        print(f"could not write the plot to {where}: {e}", file=sys.stderr)
        return None


def send_logs_to(path: Path) -> Path:
    """Ray's, Serve's, vLLM's and the HTTP client's log lines in this process go to `path`,
    not the console, so the demo's own lines stand out (the cluster's processes log to
    Ray's session folder already; Ray's root handler would print every request's line)."""
    import logging

    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in ("ray", "ray.serve", "ray.llm", "vllm", "transformers", "nixl", "httpx"):
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                logger.removeHandler(h)
        logger.addHandler(handler)
        logger.propagate = False
    return path


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
