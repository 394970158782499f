"""`kvfabric bench radix`: our node cache against SGLang's prefix caches on the trace.

The peers (peers.SglangCache): SGLang's default UnifiedRadixCache on its Rust TreeCore (the
anchor: what SGLang serves with), that TreeCore's binding called directly (no Python wrapper),
and the pure-Python RadixCache. Every side replays the same token sequences (trace hash ids
expanded into tokens), match then insert per request, in a fresh process each pinned to the
same CPU, with the same garbage-collector mode; every side's matched length for every request
must agree. Every side gets the same token arrays (int64, `array('q')`). Our side computes
page keys (BLAKE2b) for every page it inserts; SGLang keys its tree by the token ids
themselves; that hashing is inside our timed loop. Ours runs twice, with the
native extension (KVF_NATIVE's default) and with the pure-Python reference
(KVF_NATIVE=0); each run also times packing and keying the trace's requests alone.
Each side's figure is the best of `--repeat` runs (default 3), each a fresh process on a
fresh tree: one pass per process is all a run can time, and a pass lands on a busy
moment of the machine as often for one side as for the other.

`--capacity F` measures eviction instead: ours alone, with pages for F of what the trace
stores, so that most puts evict; per request (match then put) the mean and p99 with the
kept candidates (candidates.py) and with the reference's walk over the tree per
eviction, native and pure Python, each in a fresh process. Both must evict alike.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvfabric.deploy.sim.trace import load_trace, request_tokens

from benchmarks import peers
from benchmarks.fresh import bench_cpu, pin, run_worker
from benchmarks.sglang_worker import pack_sequences, read_sequences, write_sequences
from benchmarks.tree_memory import tree_bytes_per_page


@dataclass
class RadixFigures:
    requests: int
    tokens_per_block: int
    page_size: int
    gc_mode: str
    repeat: int
    native: bool  # whether the first run had the extension (else both are Python)
    cpu: int  # every timed process ran pinned to this CPU
    ours_ops_per_s: float
    ours_python_ops_per_s: float
    peer_ops_per_s: float  # sglang.RadixCache (pure Python)
    unified_ops_per_s: float  # sglang.UnifiedRadixCache on the Rust TreeCore
    rust_binding_ops_per_s: float  # the Rust TreeCore's binding alone
    ours_matched_tokens: int
    peer_matched_tokens: int
    pack_us: float  # per request: encode_tokens alone
    keys_us: float  # per request: packing and every page's key (PageKeyer.pack)
    pack_python_us: float
    keys_python_us: float
    tree_bytes_per_page: float  # metadata, as tracemalloc counts it (tree_memory.py)
    tree_bytes_per_page_python: float
    # Under the default collector, for the record (None when gc_mode is already default):
    # which side owes a full collection inside its timed loop decides much of it.
    ratio_default_gc: float | None = None

    @property
    def ratio(self) -> float:
        return self.ours_ops_per_s / self.peer_ops_per_s

    @property
    def ratio_vs_sglang_unified(self) -> float:
        return self.ours_ops_per_s / self.unified_ops_per_s

    @property
    def ratio_vs_sglang_rust_binding(self) -> float:
        return self.ours_ops_per_s / self.rust_binding_ops_per_s

    @property
    def ratio_python(self) -> float:
        return self.ours_python_ops_per_s / self.peer_ops_per_s


def sequences(trace: str | None, requests: int, tokens_per_block: int) -> list[list[int]]:
    return [
        request_tokens(r, tokens_per_block=tokens_per_block)
        for r in load_trace(trace, limit=requests)
    ]


def ours_worker(
    data: str,
    page_size: int,
    gc_mode: str,
    capacity: float = 1.0,
    incremental: bool = True,
    cpu: int = -1,
) -> dict:
    pin(cpu)
    from kvfabric.core.cache import native
    from kvfabric.core.cache.keys import PageKeyer, encode_tokens
    from kvfabric.core.cache.layout import KVLayout, PoolName
    from kvfabric.core.cache.node_cache import NodeCache
    from kvfabric.core.cache.pools import PoolCapacity

    # The same int64 arrays the peers' workers replay (sglang_worker.read_sequences): lists
    # of ints here cost ours ~3.5 us a request more (the trace's ~850 token objects of a
    # request lie scattered in memory, an array's ids in one run).
    seqs = read_sequences(Path(data))
    pages = int(sum(len(s) for s in seqs) // page_size * capacity) + 1
    layout = KVLayout(layers=("full",), kv_heads=1, head_dim=1, page_size=page_size)
    if gc_mode in ("collect", "freeze"):
        gc.collect()
        if gc_mode == "freeze":
            gc.freeze()
    cache = NodeCache(
        layout,
        {PoolName.FULL: PoolCapacity(pages, 0)},
        store_bytes=False,
        device="cpu",
        incremental_eviction=incremental,
    )
    matched = [0] * len(seqs)  # pages per request
    clock = time.perf_counter
    each = [0.0] * len(seqs)
    start = clock()
    for i, s in enumerate(seqs):
        t = clock()
        matched[i] = cache.match(s, "bench").usable_pages
        cache.put(s, None, "bench")
        each[i] = clock() - t
    elapsed = clock() - start
    cache.check()
    each.sort()
    keyer = PageKeyer("bench", layout.fingerprint, page_size)
    start = time.perf_counter()
    for s in seqs:
        encode_tokens(s)
    packed = time.perf_counter() - start
    start = time.perf_counter()
    for s in seqs:
        keyer.pack(s)
    keyed = time.perf_counter() - start
    return {
        "elapsed_s": elapsed,
        "matched_tokens": sum(matched) * page_size,
        "match_lengths": [m * page_size for m in matched],
        "native": native.ENABLED,
        "pack_us": packed / len(seqs) * 1e6,
        "keys_us": keyed / len(seqs) * 1e6,
        "mean_us": sum(each) / len(each) * 1e6,
        "p99_us": each[min(len(each) - 1, len(each) * 99 // 100)] * 1e6,
        "evicted": cache.evictors[PoolName.FULL].evicted,
        "snapshot": snapshot_digest(cache.snapshot()),
        "tree_bytes_per_page": tree_bytes_per_page(seqs, layout, pages) if capacity == 1 else 0,
    }


def snapshot_digest(snap: tuple) -> str:
    """A cache's snapshot as the same text in every process (no hash seed, no set order)."""
    pages, allocs, protected = snap
    text = repr((pages, [(a[0].name, int(a[1]), sorted(a[2])) for a in allocs], protected))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def run_ours(
    seqs: list[list[int]],
    page_size: int,
    gc_mode: str,
    python: bool = False,
    capacity: float = 1.0,
    incremental: bool = True,
    cpu: int = -1,
) -> dict:
    """One run in a fresh process: the native path, or the pure-Python reference (`python`)."""
    with tempfile.TemporaryDirectory(prefix="kvf-radix-") as tmp:
        data = Path(tmp) / "seqs.bin"
        write_sequences(data, *pack_sequences(seqs))
        args = [str(data), page_size, gc_mode, capacity, incremental, cpu]
        return run_worker("benchmarks.radix_bench", args, python)


@dataclass
class EvictionFigures:
    requests: int
    page_size: int
    gc_mode: str
    capacity: float
    native: bool
    evicted_pages: int
    # Per request (match then put), microseconds: kept candidates, then the walk.
    mean_us: float
    p99_us: float
    walk_mean_us: float
    walk_p99_us: float
    python_mean_us: float
    python_p99_us: float
    python_walk_mean_us: float
    python_walk_p99_us: float


def run_eviction(
    capacity: float,
    requests: int = 3000,
    tokens_per_block: int = 32,
    page_size: int = 16,
    trace: str | None = None,
    gc_mode: str = "default",
) -> EvictionFigures:
    if not 0 < capacity < 1:
        raise ValueError(f"capacity must be a fraction in (0, 1), got {capacity!r}")
    if gc_mode not in peers.GC_MODES:
        raise ValueError(f"gc_mode must be one of {peers.GC_MODES}, got {gc_mode!r}")
    seqs = sequences(trace, requests, tokens_per_block)
    runs = [
        run_ours(seqs, page_size, gc_mode, python, capacity, incremental)
        for python in (False, True)
        for incremental in (True, False)
    ]
    same = {(r["matched_tokens"], r["evicted"], r["snapshot"]) for r in runs[:2]}
    same_python = {(r["matched_tokens"], r["evicted"], r["snapshot"]) for r in runs[2:]}
    if len(same) != 1 or len(same_python) != 1 or runs[0]["evicted"] != runs[2]["evicted"]:
        raise RuntimeError(f"the runs evicted differently: {runs}")
    kept, walk, py_kept, py_walk = runs
    return EvictionFigures(
        len(seqs),
        page_size,
        gc_mode,
        capacity,
        kept["native"],
        kept["evicted"],
        kept["mean_us"],
        kept["p99_us"],
        walk["mean_us"],
        walk["p99_us"],
        py_kept["mean_us"],
        py_kept["p99_us"],
        py_walk["mean_us"],
        py_walk["p99_us"],
    )


def print_eviction(f: EvictionFigures, as_json: bool) -> None:
    print(
        f"requests {f.requests}, page {f.page_size}, gc {f.gc_mode}, pages for "
        f"{f.capacity:g} of the trace: {f.evicted_pages} pages evicted"
    )
    print(f"{'per request (us)':28}{'mean':>10}{'p99':>10}")
    native = "C tree" if f.native else "no extension!"
    for name, mean, p99 in (
        (f"kept candidates ({native})", f.mean_us, f.p99_us),
        (f"walk per eviction ({native})", f.walk_mean_us, f.walk_p99_us),
        ("kept candidates (Python)", f.python_mean_us, f.python_p99_us),
        ("walk per eviction (Python)", f.python_walk_mean_us, f.python_walk_p99_us),
    ):
        print(f"{name:28}{mean:>10.1f}{p99:>10.1f}")
    if as_json:
        out = {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(f).items()}
        print(json.dumps({"name": "radix-eviction", **out}))


def best_ours(
    seqs: list[list[int]],
    page_size: int,
    gc_mode: str,
    repeat: int,
    python: bool = False,
    cpu: int = -1,
) -> dict:
    """The fastest of `repeat` runs of ours."""
    runs = [run_ours(seqs, page_size, gc_mode, python, cpu=cpu) for _ in range(repeat)]
    return min(runs, key=lambda r: r["elapsed_s"])


def best_peer(
    seqs: list[list[int]],
    page_size: int,
    gc_mode: str,
    repeat: int,
    cache: peers.SglangCache = peers.SglangCache.PYTHON,
    cpu: int = -1,
) -> peers.RadixRun:
    """The fastest of `repeat` runs of one of SGLang's caches."""
    runs = [
        peers.run_sglang_radix(seqs, page_size, gc_mode=gc_mode, cache=cache, cpu=cpu)
        for _ in range(repeat)
    ]
    return min(runs, key=lambda r: r.elapsed_s)


def check_same_answers(ours: list[int], peer: peers.RadixRun) -> None:
    """Every request's matched length must be the same on both sides: else they did
    different work and the ratio means nothing."""
    if list(peer.match_lengths) != ours:
        bad = next(i for i, (a, b) in enumerate(zip(ours, peer.match_lengths)) if a != b)
        raise RuntimeError(
            f"{peer.cache.label} matched {peer.match_lengths[bad]} tokens for request {bad}, "
            f"ours {ours[bad]}: the sides must agree on every request"
        )


def run(
    requests: int = 3000,
    tokens_per_block: int = 32,
    page_size: int = 16,
    trace: str | None = None,
    gc_mode: str = "default",
    repeat: int = 3,
) -> RadixFigures:
    if gc_mode not in peers.GC_MODES:
        raise ValueError(f"gc_mode must be one of {peers.GC_MODES}, got {gc_mode!r}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an int >= 1, got {repeat!r}")
    seqs = sequences(trace, requests, tokens_per_block)
    cpu = bench_cpu()
    ours = best_ours(seqs, page_size, gc_mode, repeat, cpu=cpu)
    python = best_ours(seqs, page_size, gc_mode, repeat, python=True, cpu=cpu)
    if python["match_lengths"] != ours["match_lengths"]:
        raise RuntimeError(
            f"the native and Python runs matched {ours['matched_tokens']} and "
            f"{python['matched_tokens']} tokens: they must agree on every request"
        )
    peer, unified, rust = (
        best_peer(seqs, page_size, gc_mode, repeat, cache, cpu)
        for cache in (
            peers.SglangCache.PYTHON,
            peers.SglangCache.UNIFIED,
            peers.SglangCache.RUST_BINDING,
        )
    )
    for run_ in (peer, unified, rust):
        check_same_answers(ours["match_lengths"], run_)
    default_gc = None
    if gc_mode != "default":
        ours_default = best_ours(seqs, page_size, "default", repeat, cpu=cpu)
        peer_default = best_peer(seqs, page_size, "default", repeat, cpu=cpu)
        default_gc = len(seqs) / ours_default["elapsed_s"] / peer_default.ops_per_s
    return RadixFigures(
        len(seqs),
        tokens_per_block,
        page_size,
        gc_mode,
        repeat,
        ours["native"],
        cpu,
        len(seqs) / ours["elapsed_s"],
        len(seqs) / python["elapsed_s"],
        peer.ops_per_s,
        unified.ops_per_s,
        rust.ops_per_s,
        ours["matched_tokens"],
        sum(peer.match_lengths),
        ours["pack_us"],
        ours["keys_us"],
        python["pack_us"],
        python["keys_us"],
        ours["tree_bytes_per_page"],
        python["tree_bytes_per_page"],
        default_gc,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench radix", description=__doc__)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--trace", default=None, help="a Mooncake-format trace (default: the packaged one)"
    )
    ap.add_argument(
        "--gc",
        choices=peers.GC_MODES,
        default="default",
        help="garbage-collector mode for both sides: default leaves the full collection "
        "that imports owe to land inside the timed loop; collect runs it first "
        "(steady state); freeze also moves the heap out of the collector's reach",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs per side against SGLang, each a fresh process: the best counts",
    )
    ap.add_argument(
        "--capacity",
        type=float,
        default=None,
        help="measure eviction instead (ours only): pages for this fraction of what the "
        "trace stores, kept candidates against a walk over the tree per eviction",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.capacity is not None:
        ev = run_eviction(
            args.capacity, args.requests, args.tokens_per_block, args.page_size, args.trace, args.gc
        )
        print_eviction(ev, args.json)
        return 0
    f = run(args.requests, args.tokens_per_block, args.page_size, args.trace, args.gc, args.repeat)
    print(
        f"requests {f.requests}, {f.tokens_per_block} tokens/block, page {f.page_size}, gc "
        f"{f.gc_mode}, best of {f.repeat} runs a side, each pinned to CPU {f.cpu}"
    )
    print(f"{'':24}{'req/s':>12}{'matched tokens':>16}")
    ours = "ours (NodeCache, C keys)" if f.native else "ours (no extension!)"
    print(f"{ours:24}{f.ours_ops_per_s:>12.0f}{f.ours_matched_tokens:>16}")
    print(f"{'ours (pure Python)':24}{f.ours_python_ops_per_s:>12.0f}{f.ours_matched_tokens:>16}")
    for cache, rate in (
        (peers.SglangCache.UNIFIED, f.unified_ops_per_s),
        (peers.SglangCache.RUST_BINDING, f.rust_binding_ops_per_s),
        (peers.SglangCache.PYTHON, f.peer_ops_per_s),
    ):
        print(f"{cache.label:24}{rate:>12.0f}{f.peer_matched_tokens:>16}")
    print(
        f"ratio vs UnifiedRadixCache {f.ratio_vs_sglang_unified:.2f} (target >= 1.5), vs its "
        f"Rust binding {f.ratio_vs_sglang_rust_binding:.2f} (target >= 1.0), vs RadixCache "
        f"{f.ratio:.2f} (target >= 2); pure Python vs RadixCache {f.ratio_python:.2f}"
    )
    if f.ratio_default_gc is not None:
        print(f"ratio under the default collector (for the record) {f.ratio_default_gc:.2f}")
    print(
        f"per request: packing {f.pack_us:.1f} us (Python {f.pack_python_us:.1f}), packing and "
        "every "
        f"page's key {f.keys_us:.1f} us (Python {f.keys_python_us:.1f})"
    )
    print(
        f"tree metadata per cached page {f.tree_bytes_per_page:.0f} bytes "
        f"(pure Python {f.tree_bytes_per_page_python:.0f})"
    )
    if args.json:
        fine = ("_us", "ratio")  # per-request times and ratios keep 3 digits
        rounded = {
            k: round(v, 3 if k.endswith(fine[0]) or k.startswith(fine[1]) else 1)
            if isinstance(v, float)
            else v
            for k, v in asdict(f).items()
        }
        print(
            json.dumps(
                {
                    "name": "radix",
                    "peer": "sglang.RadixCache",
                    "ratio": round(f.ratio, 3),
                    "ratio_vs_sglang_unified": round(f.ratio_vs_sglang_unified, 3),
                    "ratio_vs_sglang_rust_binding": round(f.ratio_vs_sglang_rust_binding, 3),
                    "ratio_python": round(f.ratio_python, 3),
                    **rounded,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
