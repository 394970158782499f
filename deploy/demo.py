"""`kvfabric demo` (single-node stage): replay a slice of the conversation trace
through one NodeCache holding real K/V tensors in device and host tiers, and
check every cache hit against freshly computed K/V.

The K/V here come from a deterministic stand-in for a model (each token's K/V
depends on its whole prefix, as attention K/V do); the reference transformer
arrives with the Serve app.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from deploy.trace import load_trace, request_tokens
from fabric import KVLayout, NodeCache, PoolCapacity, PoolName, TierConfig, WritePolicy

LAYOUT = KVLayout(layers=("full", "swa", "full", "swa"), kv_heads=2, head_dim=16, page_size=16, window=64)


def stand_in_kv(layout: KVLayout, tokens: list[int]) -> list[torch.Tensor]:
    """Per-layer [2, T, kv_heads, head_dim] in the layout's dtype; each token's
    K/V depends on its whole prefix, as attention K/V do."""
    h, seeds = 17, []
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
        seeds.append(h)
    base = torch.tensor(seeds, dtype=torch.float64).reshape(1, len(tokens), 1, 1)
    grid = torch.arange(2 * layout.kv_heads * layout.head_dim, dtype=torch.float64)
    grid = grid.reshape(2, 1, layout.kv_heads, layout.head_dim)
    return [torch.sin(base * 1e-3 + grid * 0.37 + i * 1.7).to(layout.torch_dtype).contiguous()
            for i in range(len(layout.layers))]


def run(requests: int, tokens_per_block: int, device_pages: int, host_pages: int) -> dict:
    cache = NodeCache(LAYOUT, {PoolName.FULL: PoolCapacity(device_pages, host_pages),
                               PoolName.SWA: PoolCapacity(device_pages // 4, host_pages // 4)},
                      tier=TierConfig(policy=WritePolicy.WRITE_BACK))
    prompt_tokens = hit_tokens = mismatches = 0
    start = time.perf_counter()
    reqs = load_trace(limit=requests)
    for i, req in enumerate(reqs):
        tokens = request_tokens(req, tokens_per_block=tokens_per_block)
        kv = stand_in_kv(LAYOUT, tokens)
        hit = cache.get(tokens, "demo")
        for li, kind in enumerate(LAYOUT.layers):
            if hit.tokens:
                start_tok = 0 if kind.value == "full" else hit.swa_start
                mismatches += not torch.equal(hit.layers[li], kv[li][:, start_tok:hit.tokens])
        prompt_tokens += len(tokens)
        hit_tokens += hit.tokens
        cache.put(tokens, kv, "demo")
        if (i + 1) % max(1, len(reqs) // 10) == 0:
            end = "" if sys.stderr.isatty() else "\n"
            print(f"\r  replayed {i + 1}/{len(reqs)}", end=end, file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    cache.check()
    s = cache.stats()
    ps = LAYOUT.page_size
    return {"requests": len(reqs), "prompt_tokens": prompt_tokens, "hit_tokens": hit_tokens,
            "hit_rate": round(hit_tokens / max(1, prompt_tokens), 4),
            "hit_tokens_device": s.hit_pages_device * ps, "hit_tokens_host": s.hit_pages_host * ps,
            "evicted_pages": sum(e.evicted for e in cache.evictors.values()),
            "written_back_pages": sum(e.written_back for e in cache.evictors.values()),
            "loaded_back_pages": cache.tiers.loaded_back, "output_mismatches": mismatches,
            "seconds": round(time.perf_counter() - start, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric demo", description=__doc__)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--device-pages", type=int, default=4096)
    ap.add_argument("--host-pages", type=int, default=16384)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for name in ("requests", "tokens_per_block", "device_pages", "host_pages"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    print(f"single-node cache demo: {args.requests} trace requests, layout {LAYOUT.to_dict()}")
    r = run(args.requests, args.tokens_per_block, args.device_pages, args.host_pages)
    print(f"hit rate {r['hit_rate']:.1%}  (device {r['hit_tokens_device']} tokens, host {r['hit_tokens_host']})")
    print(f"evicted {r['evicted_pages']} pages, wrote back {r['written_back_pages']}, "
          f"loaded back {r['loaded_back_pages']}; mismatches against recomputed K/V: {r['output_mismatches']}")
    if args.json:
        print(json.dumps(r))
    return 1 if r["output_mismatches"] else 0
