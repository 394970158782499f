"""`kvfabric replay`'s options, table and plot."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from .engine import CostModel
from .sim_cluster import Mode, SimConfig

_DEFAULTS = SimConfig()


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, SimConfig]:
    """Parse and validate; bad options exit 2 with argparse's usage message."""
    from .simulate import __doc__ as doc
    ap = argparse.ArgumentParser(prog="kvfabric replay", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = _DEFAULTS
    ap.add_argument("--trace", default=None, help="a Mooncake-format JSONL trace (default: the packaged one)")
    ap.add_argument("--nodes", type=int, default=d.nodes, help="prefill nodes (default %(default)s)")
    ap.add_argument("--capacity-tokens", type=int, default=d.capacity_tokens,
                    help="KV-cache capacity per node, in tokens (default %(default)s)")
    ap.add_argument("--shards", type=int, default=d.shards, help="index shards (default %(default)s)")
    ap.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=d.cost.prefill_tokens_per_s,
                    help="prefill throughput of one node (default %(default)s: a 7B-class model on one GPU)")
    ap.add_argument("--transfer-bytes-per-s", type=float, default=d.cost.transfer_bytes_per_s,
                    help="node-to-node KV bandwidth (default %(default)s: a 100 Gb/s NIC)")
    ap.add_argument("--kv-bytes-per-token", type=int, default=d.kv_bytes_per_token,
                    help="KV bytes per token (default %(default)s: Llama-3-8B in fp16)")
    ap.add_argument("--overhead-ms", type=float, default=d.overhead_s * 1e3,
                    help="per-request overhead: scheduling, first decode step (default %(default)s)")
    ap.add_argument("--fetch-overhead-ms", type=float, default=d.cost.fetch_overhead_s * 1e3,
                    help="per-fetch overhead: lookup, export grant, lease, commit (default %(default)s)")
    ap.add_argument("--load-bound", type=int, default=d.load_bound,
                    help="local mode: requests a node may have queued beyond the least loaded one and "
                         "still be chosen for its cached prefix (default %(default)s)")
    ap.add_argument("--page-tokens", type=int, default=d.page_tokens,
                    help="token ids per simulated page, at least 2 (one page stands for one 512-token "
                         "block; with 1, different blocks would collide on a token) (default %(default)s)")
    ap.add_argument("--plot", default=None, metavar="PATH",
                    help="write a PNG of hit rate against capacity per mode (runs 0.25x, 0.5x, 2x capacity too)")
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = ap.parse_args(argv)
    if args.page_tokens < 2:
        ap.error("--page-tokens must be at least 2")
    for name in ("nodes", "capacity_tokens", "shards", "kv_bytes_per_token"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.capacity_tokens < 512:
        ap.error("--capacity-tokens must be at least 512 (one trace block)")
    if args.requests is not None and args.requests < 1:
        ap.error("--requests must be at least 1")
    if args.load_bound < 0:
        ap.error("--load-bound must be >= 0")
    for name in ("prefill_tokens_per_s", "transfer_bytes_per_s"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            ap.error(f"--{name.replace('_', '-')} must be a positive number")
    for name in ("overhead_ms", "fetch_overhead_ms"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            ap.error(f"--{name.replace('_', '-')} must be a number >= 0")
    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        ap.error(f"--plot: directory {Path(args.plot).parent} does not exist")
    cost = CostModel(args.prefill_tokens_per_s, args.transfer_bytes_per_s, args.fetch_overhead_ms / 1e3)
    config = SimConfig(nodes=args.nodes, capacity_tokens=args.capacity_tokens, shards=args.shards,
                       page_tokens=args.page_tokens, load_bound=args.load_bound,
                       overhead_s=args.overhead_ms / 1e3, kv_bytes_per_token=args.kv_bytes_per_token,
                       cost=cost)
    return args, config


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def print_table(result, trace: str | None) -> None:
    """The table of `result` (a simulate.Replay) on stdout."""
    c = result.config
    print(f"kvfabric replay: {result.requests} requests of {Path(trace).name if trace else 'the packaged trace'}, "
          f"{c.nodes} nodes x {c.capacity_tokens:,} tokens, {c.shards} index shards")
    head = f"{'mode':<9} {'hit rate':>8} {'prefill tokens':>15} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} " \
           f"{'bytes moved':>12} {'shard max/mean':>15}"
    print(head)
    print("-" * len(head))
    for mode, r in result.main.items():
        bal = f"{r.shard_balance:.3f}" if r.shard_balance is not None else "-"
        print(f"{mode.value:<9} {r.hit_rate:>8.3f} {r.prefill_tokens:>15,} {r.ttft_ms(0.5):>12.1f} "
              f"{r.ttft_ms(0.99):>12.1f} {_bytes(r.bytes_moved):>12} {bal:>15}")
    gl, gi = result.ratio(Mode.GLOBAL, Mode.LOCAL), result.ratio(Mode.GLOBAL, Mode.INFINITE)
    g = result.main[Mode.GLOBAL]
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"   # noqa: E731
    print(f"global/local hit rate {fmt(gl)} (Mooncake: 2.22x conversation, 2.36x synthetic); "
          f"global/infinite {fmt(gi)} (target >= 0.95); shard load max/mean {fmt(g.shard_balance)} "
          f"(target <= 1.25)")
    print(f"index check: {g.index_checked} sampled requests, {g.index_disagreements} where the index "
          f"disagrees with the caches; {g.fetches} remote fetches; {result.elapsed_s:.1f} s")


def write_plot(result, path: Path) -> Path:
    """Hit rate against capacity per node, one line per mode."""
    import matplotlib
    matplotlib.use("Agg")             # no display: render to a file
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = sorted({r.capacity_tokens for r in result.sweep if r.mode is not Mode.INFINITE})
    for mode in (Mode.LOCAL, Mode.GLOBAL):
        runs = sorted((r.capacity_tokens, r.hit_rate) for r in result.sweep if r.mode is mode)
        ax.plot([x for x, _ in runs], [y for _, y in runs], marker="o", label=mode.value)
    inf = result.main[Mode.INFINITE].hit_rate
    ax.plot(caps, [inf] * len(caps), linestyle="--", label="infinite")
    ax.axvline(result.config.capacity_tokens, color="grey", linewidth=0.8)
    ax.set(xscale="log", xlabel="KV capacity per node (tokens)", ylabel="prompt-token hit rate",
           title=f"{result.requests} requests, {result.config.nodes} nodes", ylim=(0, 1))
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
