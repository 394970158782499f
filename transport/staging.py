"""Shared-memory staging pages between a node's cache and an engine on the same host.

An engine process (vLLM's worker) and the node actor both map the same files in
/dev/shm, one per pool, laid out as the fabric's pages ([n, layers, 2, page, heads,
dim]). The engine copies its KV blocks in or out; the node actor copies between
these pages and its cache. Bytes never go through Ray's object store or pickling:
a Ray call carries only token ids and page numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch
from kvfabric.fabric import KVLayout, NodeCache, PoolName
from kvfabric.fabric.cache.pages import pack, unpack
from kvfabric.fabric.wire import is_int

SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class StagingSpec:
    """Where the staging files are and how many pages each holds."""

    prefix: str  # file name prefix under SHM_DIR
    pages: int

    def path(self, pool: PoolName) -> Path:
        return SHM_DIR / f"{self.prefix}-{pool.name.lower()}"


class SharedPages:
    """The staging pages of every pool of `layout`, mapped shared (created if missing)."""

    def __init__(self, spec: StagingSpec, layout: KVLayout) -> None:
        self.spec = spec
        self.layout = layout
        self.pools: dict[PoolName, torch.Tensor] = {}
        for pool in layout.pools:
            shape = (spec.pages, *layout.page_shape(pool))
            numel = 1
            for d in shape:
                numel *= d
            path = spec.path(pool)
            _ensure_file(path, numel * layout.torch_dtype.itemsize)
            flat = torch.from_file(str(path), shared=True, size=numel, dtype=layout.torch_dtype)
            self.pools[pool] = flat.view(shape)

    def unlink(self) -> None:
        for pool in self.pools:
            try:
                self.spec.path(pool).unlink()
            except FileNotFoundError:
                continue  # already gone: unlinking is idempotent


def _ensure_file(path: Path, size: int) -> None:
    # O_CREAT without O_EXCL: the engine's two processes and the node actor may race to
    # create it; ftruncate to the same size is idempotent.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)


@dataclass
class StagedHit:
    """What `load_to_staging` put in the staging pages: each pool's KV for pages
    [firsts[pool], pages). The load starts at `first_page`; a pool whose policy needs
    less (a window) starts later."""

    pages: int = 0
    first_page: int = 0
    firsts: dict[PoolName, int] = field(default_factory=dict)
    host_pages: int = 0  # of those pages, how many the cache loaded back from host
    slots: dict[PoolName, list[int]] = field(default_factory=dict)


def load_to_staging(
    cache: NodeCache,
    shared: SharedPages,
    tokens: Sequence[int],
    namespace: str,
    skip_pages: int,
    slots: dict[PoolName, list[int]],
) -> StagedHit:
    """Copy the usable cached prefix of `tokens` beyond `skip_pages` into staging `slots`
    (the pool's i-th staged page goes to slots[pool][i]); nothing if they are too few."""
    layout = cache.layout
    ps = layout.page_size
    hit = cache.get(tokens, namespace)
    n = hit.tokens // ps
    held = {pool: start // ps for pool, start in hit.starts.items()}  # the hit's rows start there
    out = StagedHit(
        pages=n,
        first_page=skip_pages,
        firsts={p: max(skip_pages, held[p]) for p in layout.pools},
        host_pages=hit.host_tokens // ps,
    )
    if n <= skip_pages:
        return StagedHit()
    # Each pool stages pages [firsts[pool], n): all of them for full attention, the window
    # before n for SWA. A shorter load than the hit would need the SWA window before its
    # own end, which the hit does not carry: a pool with too few slots loads nothing.
    wanted = {p: range(out.firsts[p] - held[p], n - held[p]) for p in layout.pools}
    if any(len(slots.get(p, ())) < len(rows) for p, rows in wanted.items()):
        return StagedHit()
    for pool, rows in wanted.items():
        if not rows:
            continue
        positions = list(rows)
        dst = slots[pool][: len(positions)]
        pages = pack(layout, pool, hit.layers, positions)
        shared.pools[pool].index_copy_(0, torch.tensor(dst, dtype=torch.long), pages.to("cpu"))
        out.slots[pool] = dst
    return out


def save_from_staging(
    cache: NodeCache,
    shared: SharedPages,
    tokens: Sequence[int],
    namespace: str,
    slots: dict[PoolName, list[int]],
    firsts: Mapping[PoolName, int],
) -> int:
    """Store the whole pages of `tokens` from staging: a pool's KV of page firsts[pool] + i
    in slots[pool][i] (pools not in `firsts` from page 0). Full KV from a later page grows
    the cache only where it holds every page before (NodeCache.put). `tokens` are those
    the engine computed, a partial last page included: on a page end, the put keeps the
    window a repeat of them needs too (NodeCache.put). Returns pages newly stored."""
    layout = cache.layout
    ps = layout.page_size
    n = len(tokens) // ps
    if set(firsts) - set(layout.pools) or not all(is_int(f) and f >= 0 for f in firsts.values()):
        raise ValueError(
            f"first pages must be ints >= 0 for pools of the layout, got {dict(firsts)!r}"
        )
    kv: list[torch.Tensor | None] = [None] * len(layout.layers)
    starts: dict[PoolName, int] = {}
    for pool in layout.pools:
        first = firsts.get(pool, 0)
        idx = slots.get(pool, [])
        if len(idx) != n - first:
            raise ValueError(f"{pool.name}: {len(idx)} staged pages for positions [{first}, {n})")
        starts[pool] = first * ps  # rows before it were never staged: not stored
        staged = shared.pools[pool].index_select(0, torch.tensor(idx, dtype=torch.long))
        for li, t in zip(layout.layers_of(pool), unpack(staged)):  # [2, (n - first) * ps, H, D]
            kv[li] = t
    return cache.put(tokens, kv, namespace, starts=starts)
