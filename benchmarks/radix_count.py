"""`kvfabric bench radix`'s timed loop (ours: match then put per request) alone, in this
process, for callgrind's instruction counts: repeatable where wall time on a shared
machine is not. Under `valgrind --tool=callgrind --instr-atstart=no` only the loop is
counted (the imports, the trace and the cache's set-up are not); run plainly, it prints
the loop's wall time. docs/c-tree-decision.md has the commands and the figures.

--tree picks a path KVF_NATIVE cannot (it switches all of core/cache at once), the
native keys and allocator kept: `python`, the pure-Python tree over nodes.py; `kernels`,
radix.py's RadixTree methods in Python over the C primitives and C TreeNodes (what the
native tree was before RadixTree.insert_free became one C call)."""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.radix_bench import sequences

# CALLGRIND_{ZERO_STATS,START,STOP}_INSTRUMENTATION are client requests (no-ops outside
# valgrind); Python reaches them through a three-function library built on the spot.
_TOGGLE = """#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT("loop"); }
"""


def _toggle(folder: Path) -> ctypes.CDLL:
    src, lib = folder / "toggle.c", folder / "toggle.so"
    src.write_text(_TOGGLE)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", lib, src], check=True)
    return ctypes.CDLL(str(lib))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.radix_count", description=__doc__)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tree", choices=("default", "python", "kernels"), default="default")
    args = ap.parse_args(argv)

    from kvfabric.core.cache import native, node_cache, radix
    from kvfabric.core.cache.layout import KVLayout, PoolName
    from kvfabric.core.cache.node_cache import NodeCache
    from kvfabric.core.cache.pools import PoolCapacity

    if args.tree == "python":
        radix.EXT = None  # RadixTree then builds the Python tree over nodes.py
    elif args.tree == "kernels":

        class KernelsTree(radix.RadixTree):
            """A subclass is not swapped for _NativeRadixTree: Python methods, C _ops."""

        node_cache.RadixTree = KernelsTree  # type: ignore[misc]
    seqs = sequences(None, args.requests, args.tokens_per_block)
    pages = sum(len(s) for s in seqs) // args.page_size + 1
    layout = KVLayout(layers=("full",), kv_heads=1, head_dim=1, page_size=args.page_size)
    cache = NodeCache(
        layout, {PoolName.FULL: PoolCapacity(pages, 0)}, store_bytes=False, device="cpu"
    )
    with tempfile.TemporaryDirectory(prefix="kvf-count-") as tmp:
        toggle = _toggle(Path(tmp))
        gc.collect()  # bench radix --gc collect: no import debt inside the loop
        matched = 0
        toggle.start()
        start = time.perf_counter()
        for s in seqs:
            matched += cache.match(s, "bench").usable_pages
            cache.put(s, None, "bench")
        elapsed = time.perf_counter() - start
        toggle.stop()
    cache.check()
    figures = {
        "requests": len(seqs),
        "keys_native": native.ENABLED,
        "tree": type(cache.tree).__name__,
        "tree_native": cache.tree.native,
        "matched_pages": matched,
        "loop_s": round(elapsed, 4),
        "us_per_request": round(elapsed / len(seqs) * 1e6, 1),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
