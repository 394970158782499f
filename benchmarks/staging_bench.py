"""A node's load of a cached prefix into an engine's staging pages, against memcpy.

What the node actor runs for an engine's hit (`load_to_staging`: the cache's get, pages
loaded back to device if need be, then copied into the engine's shared-memory slots),
timed in this process on the vLLM demo model stretched to a long prompt (8 layers, 2 KV
heads x 64, fp32, pages of 32 tokens; 3 of 4 layers full attention, 1 sliding window of
1,024 tokens), against the limit: one copy of the same bytes between two tensors of this
process (`torch.Tensor.copy_` of one contiguous block), in the same run. Twice: into
staging slots in one run (a fresh engine's: the pages go straight in) and into scattered
ones (a churned allocator's: a gather, then a scatter), and into scattered slots from a
cache that holds every page on its host tier only (a host-tier hit).

Steady state: a warm-up pass first (page faults of the pools and staging, the
allocator's first blocks), then the median of `--repeat` passes; Python's collector
runs before timing and is off while timing (the copies allocate few objects). One
thread (torch.set_num_threads(1)): the node actor copies on one core.
Run: .venv/bin/kvfabric bench staging [--tokens N] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import uuid

import torch
from kvfabric.core.cache.layout import KVLayout, PoolName, Tier
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.transport.staging import (
    StagingPages,
    StagingSpec,
    load_to_staging,
    save_from_staging,
)

LAYOUT = KVLayout(
    layers=("full", "full", "full", "swa") * 2,
    kv_heads=2,
    head_dim=64,
    page_size=32,
    window=1024,
    tag="staging-bench",
)


def timed(fn, repeat: int, before=None) -> float:
    """Median seconds of `fn()` over `repeat` runs after one warm-up, collector off;
    `before()`, if given, runs untimed before each."""
    if before is not None:
        before()
    fn()
    gc.collect()
    gc.disable()
    try:
        times = []
        for _ in range(repeat):
            if before is not None:
                before()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    finally:
        gc.enable()
    return statistics.median(times)


def run(tokens: int, repeat: int) -> dict:
    torch.set_num_threads(1)
    pages = tokens // LAYOUT.page_size
    cache = NodeCache(
        LAYOUT, {p: PoolCapacity(device=pages + 8, host=0) for p in LAYOUT.pools}, device="cpu"
    )
    prompt = list(range(1, pages * LAYOUT.page_size + 2))
    kv = [torch.randn(2, len(prompt), LAYOUT.kv_heads, LAYOUT.head_dim) for _ in LAYOUT.layers]
    if cache.put(prompt, kv, "bench") < pages:
        raise RuntimeError("the cache did not take the whole prompt")
    window = LAYOUT.window_pages
    spec = StagingSpec(f"kvf-bench-{uuid.uuid4().hex[:8]}", pages)
    shared = StagingPages(spec, LAYOUT)
    try:
        slots = {
            p: list(range(pages if p == PoolName.FULL else min(pages, window)))
            for p in LAYOUT.pools
        }
        nbytes = sum(
            LAYOUT.page_bytes(p) * len(s) for p, s in slots.items()
        )  # what a hit moves into staging

        scattered = {p: s[::-1] for p, s in slots.items()}  # a churned allocator's slots

        def load(into: dict[PoolName, list[int]]) -> None:
            hit = load_to_staging(cache, shared, prompt, "bench", 0, into)
            assert hit.pages == pages

        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        node_s = timed(lambda: load(slots), repeat)
        scattered_s = timed(lambda: load(scattered), repeat)
        # A host-tier hit: the same prompt in a cache whose device tier let it go to host
        # (write-back), put back there before each pass.
        hosted = NodeCache(
            LAYOUT,
            {p: PoolCapacity(device=pages + 8, host=pages + 8) for p in LAYOUT.pools},
            device="cpu",
        )
        hosted.put(prompt, kv, "bench")

        def to_host() -> None:
            for p in LAYOUT.pools:
                hosted.evict(p, Tier.DEVICE, pages + 8)

        def host_load() -> None:
            hit = load_to_staging(hosted, shared, prompt, "bench", 0, scattered)
            assert hit.pages == pages and hit.host_pages == pages, hit

        host_s = timed(host_load, repeat, before=to_host)
        memcpy_s = timed(lambda: dst.copy_(src), repeat)
        # The engine's save of the same prompt from the same slots, into a cache that
        # holds none of it (made afresh for each pass, outside the timing).
        firsts = {p: pages - len(s) for p, s in slots.items()}
        save_times = []
        for _ in range(repeat + 1):
            target = NodeCache(
                LAYOUT,
                {p: PoolCapacity(device=pages + 8, host=0) for p in LAYOUT.pools},
                device="cpu",
            )
            target.put(prompt[:1], None, "warm")  # nothing stored: its code paths loaded
            gc.collect()
            t = time.perf_counter()
            stored = save_from_staging(target, shared, prompt, "bench", slots, firsts)
            save_times.append(time.perf_counter() - t)
            if stored != pages:
                raise RuntimeError(f"the save stored {stored} of {pages} pages")
        save_s = statistics.median(save_times[1:])  # the first: warm-up
    finally:
        shared.unlink()
    return {
        "name": "staging",
        "tokens": pages * LAYOUT.page_size,
        "bytes": nbytes,
        "node_load_ms": round(node_s * 1e3, 3),
        "memcpy_ms": round(memcpy_s * 1e3, 3),
        "ratio_vs_memcpy": round(node_s / memcpy_s, 2),  # 1.0: at the limit
        "scattered_load_ms": round(scattered_s * 1e3, 3),
        "ratio_vs_memcpy_scattered": round(scattered_s / memcpy_s, 2),
        "host_load_ms": round(host_s * 1e3, 3),  # the scattered slots, every page on host
        "host_ratio_vs_memcpy": round(host_s / memcpy_s, 2),
        "node_save_ms": round(save_s * 1e3, 3),
        "save_ratio_vs_memcpy": round(save_s / memcpy_s, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench staging", description=__doc__)
    ap.add_argument("--tokens", type=int, default=16384, help="the cached prefix's length")
    ap.add_argument("--repeat", type=int, default=15, help="timed passes (the median counts)")
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args(argv)
    if args.tokens < LAYOUT.page_size or args.repeat < 1:
        ap.error(f"--tokens must be >= {LAYOUT.page_size} and --repeat >= 1")
    r = run(args.tokens, args.repeat)
    print(
        f"a node's load of {r['tokens']} tokens ({r['bytes'] / 2**20:.1f} MiB) into staging: "
        f"{r['node_load_ms']} ms into slots in one run, {r['scattered_load_ms']} ms into "
        f"scattered slots, {r['host_load_ms']} ms from the host tier; memcpy of the same "
        f"bytes {r['memcpy_ms']} ms; ratios {r['ratio_vs_memcpy']}, "
        f"{r['ratio_vs_memcpy_scattered']} and {r['host_ratio_vs_memcpy']} (1.0: the limit); the "
        f"node's save of them from staging {r['node_save_ms']} ms, ratio "
        f"{r['save_ratio_vs_memcpy']}"
    )
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
