"""`kvfabric replay`'s options, table and plot."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from kvfabric.core.index.replication import ReplicationConfig
from kvfabric.deploy.placement import CostModel

from .cluster import Mode, SimConfig
from .trace import BLOCK_TOKENS

_DEFAULTS = SimConfig()
DEFAULT_CAPACITIES = (1_000_000, 3_000_000)


def _capacities(text: str) -> list[int]:
    """One or more token counts, comma-separated (the option also takes several words)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not out or any(c < BLOCK_TOKENS for c in out):
        raise argparse.ArgumentTypeError(
            f"each capacity must be at least {BLOCK_TOKENS} (one trace block)"
        )
    return out


def _modes(text: str) -> list[Mode]:
    try:
        return [Mode(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"modes are {', '.join(m.value for m in Mode)}; got {text!r}"
        ) from None


def parse_args(argv: list[str] | None, doc: str | None) -> tuple[argparse.Namespace, SimConfig]:
    """Parse and validate (`doc`: the command's description, replay.py's docstring); bad
    options exit 2 with argparse's usage message."""
    ap = argparse.ArgumentParser(
        prog="kvfabric replay",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = _DEFAULTS
    ap.add_argument(
        "--trace", default=None, help="a Mooncake-format JSONL trace (default: the packaged one)"
    )
    ap.add_argument(
        "--modes",
        type=_modes,
        nargs="+",
        default=None,
        help=f"modes to run (default all: {', '.join(m.value for m in Mode)})",
    )
    ap.add_argument(
        "--nodes", type=int, default=d.nodes, help="prefill nodes (default %(default)s)"
    )
    ap.add_argument(
        "--capacity-tokens",
        type=_capacities,
        nargs="+",
        default=None,
        help="KV-cache capacity per node in tokens, one or more: every mode runs at each "
        f"(default {' '.join(map(str, DEFAULT_CAPACITIES))}); the first is the headline",
    )
    ap.add_argument(
        "--host-tokens",
        type=int,
        default=d.host_tokens,
        help="host-memory KV tier per node in tokens, under the device's: pages the device "
        f"evicts go there (0: none; else at least {BLOCK_TOKENS}) (default %(default)s)",
    )
    ap.add_argument(
        "--disk-tokens",
        type=int,
        default=d.disk_tokens,
        help="disk KV tier per node in tokens, under the host's: pages the host evicts go "
        f"there (0: none; else at least {BLOCK_TOKENS}) (default %(default)s)",
    )
    ap.add_argument(
        "--shards", type=int, default=d.shards, help="index shards (default %(default)s)"
    )
    ap.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    ap.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=d.cost.prefill_tokens_per_s,
        help="prefill throughput of one node (default %(default)s: an 8B-class model on one GPU)",
    )
    ap.add_argument(
        "--transfer-bytes-per-s",
        type=float,
        default=d.cost.transfer_bytes_per_s,
        help="node-to-node KV bandwidth (default %(default)s: a 100 Gb/s NIC)",
    )
    ap.add_argument(
        "--host-read-bytes-per-s",
        type=float,
        default=d.cost.host_read_bytes_per_s,
        help="host-to-device read bandwidth of a node's own pages (default %(default)s: PCIe "
        "4.0 x16 as copies reach it)",
    )
    ap.add_argument(
        "--disk-read-bytes-per-s",
        type=float,
        default=d.cost.disk_read_bytes_per_s,
        help="disk-to-device read bandwidth of a node's own pages (default %(default)s: one "
        "PCIe 4.0 NVMe drive)",
    )
    ap.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=d.kv_bytes_per_token,
        help="KV bytes per token (default %(default)s: Llama-3-8B in fp16)",
    )
    ap.add_argument(
        "--overhead-ms",
        type=float,
        default=d.overhead_s * 1e3,
        help="per-request overhead: scheduling, first decode step (default %(default)s)",
    )
    ap.add_argument(
        "--fetch-overhead-ms",
        type=float,
        default=d.cost.fetch_overhead_s * 1e3,
        help="per-fetch overhead: lookup, export grant, lease, commit (default %(default)s)",
    )
    ap.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=d.decode_s_per_token * 1e3,
        help="time per output token; a request holds its place in the node's queue "
        "until its output is decoded (default %(default)s)",
    )
    ap.add_argument(
        "--affinity-match-rate",
        type=float,
        default=d.match_rate_threshold,
        help="affinity: PrefixCacheAffinityRouter's match_rate_threshold (default %(default)s)",
    )
    ap.add_argument(
        "--affinity-imbalance",
        type=float,
        default=d.imbalanced_threshold,
        help="affinity: its imbalanced_threshold, queue length difference (default %(default)s)",
    )
    ap.add_argument(
        "--seed", type=int, default=d.seed, help="the random routers' seed (default %(default)s)"
    )
    ap.add_argument(
        "--page-tokens",
        type=int,
        default=d.page_tokens,
        help="token ids per simulated page, at least 2 (one page stands for one 512-token "
        "block; with 1, different blocks would collide on a token) (default %(default)s)",
    )
    r = d.replication
    ap.add_argument(
        "--replicate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="global: copy hot prefixes to more nodes ahead of demand, and compare against "
        "a run without (default on)",
    )
    ap.add_argument(
        "--replica-threshold",
        type=int,
        default=r.threshold,
        help="remote fetches of a prefix within the window that make it hot (default %(default)s)",
    )
    ap.add_argument(
        "--replica-window-s",
        type=float,
        default=r.window_s,
        help="the window, in simulated seconds; a replica not hit within it goes cold "
        "(default %(default)s)",
    )
    ap.add_argument(
        "--replica-budget",
        type=float,
        default=r.budget_fraction,
        help="the share of each node's capacity replicas may take (default %(default)s)",
    )
    ap.add_argument(
        "--replica-fanout",
        type=int,
        default=r.fanout,
        help="new copies of a hot prefix per decision (default %(default)s)",
    )
    ap.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="write a PNG of hit rate and TTFT p50 against capacity, per mode",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = ap.parse_args(argv)
    args.capacity_tokens = (
        [c for group in args.capacity_tokens for c in group]
        if args.capacity_tokens
        else list(DEFAULT_CAPACITIES)
    )
    args.modes = (
        list(dict.fromkeys(m for group in args.modes for m in group)) if args.modes else list(Mode)
    )
    if args.page_tokens < 2:
        ap.error("--page-tokens must be at least 2")
    for name in ("nodes", "shards", "kv_bytes_per_token"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.requests is not None and args.requests < 1:
        ap.error("--requests must be at least 1")
    for name in ("host_tokens", "disk_tokens"):
        if not (getattr(args, name) == 0 or getattr(args, name) >= BLOCK_TOKENS):
            ap.error(
                f"--{name.replace('_', '-')} must be 0 (no such tier) or at least {BLOCK_TOKENS}"
            )
    if args.disk_tokens and not args.host_tokens:
        ap.error("--disk-tokens needs --host-tokens: the disk takes what the host evicts")
    for name in (
        "prefill_tokens_per_s",
        "transfer_bytes_per_s",
        "host_read_bytes_per_s",
        "disk_read_bytes_per_s",
    ):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            ap.error(f"--{name.replace('_', '-')} must be a positive number")
    for name in ("overhead_ms", "fetch_overhead_ms", "decode_ms_per_token"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            ap.error(f"--{name.replace('_', '-')} must be a number >= 0")
    if not 0 <= args.affinity_match_rate <= 1:
        ap.error("--affinity-match-rate must be in [0, 1]")
    if not args.affinity_imbalance >= 0:
        ap.error("--affinity-imbalance must be >= 0 (inf: never)")
    if args.replica_threshold < 1 or args.replica_fanout < 1:
        ap.error("--replica-threshold and --replica-fanout must be at least 1")
    if not (math.isfinite(args.replica_window_s) and args.replica_window_s > 0):
        ap.error("--replica-window-s must be a positive number")
    if not 0 <= args.replica_budget <= 1:
        ap.error("--replica-budget must be in [0, 1]")
    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        ap.error(f"--plot: directory {Path(args.plot).parent} does not exist")
    cost = CostModel(
        args.prefill_tokens_per_s,
        args.transfer_bytes_per_s,
        args.fetch_overhead_ms / 1e3,
        args.host_read_bytes_per_s,
        args.disk_read_bytes_per_s,
    )
    config = SimConfig(
        nodes=args.nodes,
        capacity_tokens=args.capacity_tokens[0],
        host_tokens=args.host_tokens,
        disk_tokens=args.disk_tokens,
        shards=args.shards,
        page_tokens=args.page_tokens,
        overhead_s=args.overhead_ms / 1e3,
        kv_bytes_per_token=args.kv_bytes_per_token,
        cost=cost,
        decode_s_per_token=args.decode_ms_per_token / 1e3,
        match_rate_threshold=args.affinity_match_rate,
        imbalanced_threshold=args.affinity_imbalance,
        seed=args.seed,
        replication=ReplicationConfig(
            enabled=args.replicate,
            threshold=args.replica_threshold,
            window_s=args.replica_window_s,
            budget_fraction=args.replica_budget,
            fanout=args.replica_fanout,
        ),
    )
    return args, config


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def print_table(result, trace: str | None) -> None:
    """The table of `result` (a simulate.Replay) on stdout: one block per capacity."""
    c = result.config
    print(
        f"kvfabric replay: {result.requests} requests of "
        f"{Path(trace).name if trace else 'the packaged trace'}, "
        f"{c.nodes} nodes, {c.shards} index shards; {result.elapsed_s:.1f} s"
    )
    if c.host_tokens or c.disk_tokens:
        print(
            f"tiers below each node's device: host {c.host_tokens:,} tokens "
            f"({_bytes(c.cost.host_read_bytes_per_s)}/s), disk {c.disk_tokens:,} tokens "
            f"({_bytes(c.cost.disk_read_bytes_per_s)}/s)"
        )
    head = (
        f"{'mode':<9} {'hit rate':>8} {'prefill tokens':>15} {'TTFT p50 ms':>12} "
        f"{'TTFT p99 ms':>12} "
        f"{'E2E p50 ms':>11} {'bytes moved':>12} {'shard max/mean':>15}"
    )
    for point in result.points:
        print(f"\n{point.capacity_tokens:,} tokens per node")
        print(head)
        print("-" * len(head))
        for mode, r in point.modes.items():
            bal = f"{r.shard_balance:.3f}" if r.shard_balance is not None else "-"
            print(
                f"{mode.value:<9} {r.hit_rate:>8.3f} {r.prefill_tokens:>15,} "
                f"{r.ttft_ms(0.5):>12.1f} "
                f"{r.ttft_ms(0.99):>12.1f} {r.e2e_ms(0.5):>11.1f} {_bytes(r.bytes_moved):>12} "
                f"{bal:>15}"
            )
        print(
            f"global over pow2 {_fmt(point.ratio(Mode.GLOBAL, Mode.POW2))} (goal >= 1.5), "
            f"affinity {_fmt(point.ratio(Mode.GLOBAL, Mode.AFFINITY))} (goal >= 1.1), "
            f"pooled {_fmt(point.ratio(Mode.GLOBAL, Mode.POOLED))}, "
            f"infinite {_fmt(point.ratio(Mode.GLOBAL, Mode.INFINITE))} (hit rate); TTFT p50 over "
            "pow2 "
            f"{_fmt(point.ttft_ratio(Mode.GLOBAL, Mode.POW2))}, over affinity "
            f"{_fmt(point.ttft_ratio(Mode.GLOBAL, Mode.AFFINITY))}"
        )
        if c.host_tokens:
            print(
                "hit tokens by tier (own device/host/disk, another node's): "
                + "; ".join(
                    f"{mode.value} " + "/".join(f"{n:,}" for n in r.hits_by_tier().values())
                    for mode, r in point.modes.items()
                )
            )
        g = point.modes.get(Mode.GLOBAL)
        if g is not None:
            print(
                f"index check: {g.index_checked} sampled requests, {g.index_disagreements} where "
                "the index "
                f"disagrees with the caches; {g.fetches} remote fetches"
            )
        rep = point.replication()
        if rep is not None:
            on, off = rep["on"], rep["off"]
            print(
                f"replication: {on['fetches']} remote fetches against {off['fetches']} off, "
                f"TTFT p99 {on['ttft_p99_ms']:.1f} ms against {off['ttft_p99_ms']:.1f}, "
                f"p50 {on['ttft_p50_ms']:.1f} against {off['ttft_p50_ms']:.1f}"
            )


def write_plot(result, path: Path) -> Path:
    """Hit rate and TTFT p50 against capacity per node, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to a file
    import matplotlib.pyplot as plt

    fig, (hit, ttft) = plt.subplots(1, 2, figsize=(11, 4.5))
    modes = list(dict.fromkeys(m for p in result.points for m in p.modes))
    for mode in modes:
        runs = sorted((p.capacity_tokens, p.modes[mode]) for p in result.points if mode in p.modes)
        style = {"linestyle": "--"} if mode in (Mode.POOLED, Mode.INFINITE) else {"marker": "o"}
        hit.plot([x for x, _ in runs], [r.hit_rate for _, r in runs], label=mode.value, **style)
        ttft.plot(
            [x for x, _ in runs], [r.ttft_ms(0.5) for _, r in runs], label=mode.value, **style
        )
    hit.set(
        xscale="log",
        xlabel="KV capacity per node (tokens)",
        ylabel="prompt-token hit rate",
        ylim=(0, 1),
    )
    ttft.set(xscale="log", xlabel="KV capacity per node (tokens)", ylabel="TTFT p50 (ms)")
    ttft.set_ylim(bottom=0)
    fig.suptitle(f"{result.requests} requests, {result.config.nodes} nodes")
    hit.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
