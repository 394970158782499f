"""The node cache's metadata bytes per cached page: what `kvfabric bench radix` reports
beside its speed (the index's own is `kvfabric bench index`'s bytes per key).

A fresh cache with no K/V bytes replays the trace's puts under tracemalloc, started
after the cache (and its page allocator, sized by capacity, not by what is cached) was
built: what it counts is the tree's nodes, page keys, token bytes, page lists and maps,
plus the walk memo's one request. C nodes allocate through Python's allocators, so
tracemalloc sees the native tree as it sees the Python one."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Sequence

from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity


def tree_bytes_per_page(seqs: Sequence[Sequence[int]], layout: KVLayout, pages: int) -> float:
    cache = NodeCache(
        layout, {PoolName.FULL: PoolCapacity(pages, 0)}, store_bytes=False, device="cpu"
    )
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for s in seqs:
            cache.put(s, None, "bench")
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    cache.check()
    return held / max(1, cache.tree.page_count)
