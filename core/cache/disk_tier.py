"""The disk tier as the tree sees it: what names a page written there, and the pages a
disk store held at start put back into the tree (adoption, for a warm restart).

A page on disk is recorded with its key, its parent's key, its position and its tokens
(disk_records.py), so that adoption rebuilds runs without the tenant's name or a hash:
the pages of the pool that keeps nodes alive are chained parent to child from position
0, and each chain becomes runs of the tree whose pages lie on the disk tier only. A page
whose chain breaks (its parent was never written, or was overwritten) cannot serve a
match, so it is not adopted and its slot is freed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .disk_records import PageMeta, Put
from .disk_store import DiskStore
from .layout import PoolName, Tier
from .radix import Placement, RadixTree, TreeNode
from .txn import Transaction

DISK = Tier.DISK


def page_metas(node: TreeNode, offsets: Sequence[int], page_bytes: int) -> list[PageMeta]:
    """What names the pages at `offsets` of `node`'s run, for their disk records."""
    out = []
    for j in offsets:
        parent = node.keys[j - 1] if j else node.up.keys[-1]  # a root's keys: [its key]
        tokens = node.tokens[j * page_bytes : (j + 1) * page_bytes]
        out.append(PageMeta(parent, node.start + j, node.keys[j], tokens))
    return out


@dataclass(frozen=True)
class Adopted:
    pages: int  # placed in the tree, on the disk tier
    left_out: int  # trusted by the store, but of no chain from position 0 (freed)


def adopt(
    tree: RadixTree,
    store: DiskStore,
    pools: tuple[PoolName, ...],
    puts: Sequence[Put],
    begin: Callable[[], Transaction],
) -> Adopted:
    """Put the store's trusted pages `puts` into `tree` (empty of them), in one transaction."""
    primary = pools[0]
    by_key: dict[PoolName, dict[bytes, Put]] = {p: {} for p in pools}
    left_out: list[Put] = []
    for put in puts:
        table = by_key.get(put.pool)
        if table is None or put.meta.key in table or len(put.meta.tokens) != tree.page_bytes:
            left_out.append(put)
        else:
            table[put.meta.key] = put
    children: dict[bytes, list[Put]] = {}
    for put in by_key[primary].values():
        children.setdefault(put.meta.parent, []).append(put)
    runs = _runs(children, by_key[primary])
    txn = begin()
    with txn:
        used: set[tuple[PoolName, int]] = set()
        nodes: dict[bytes, TreeNode] = {}  # the last key of each grown run -> its node
        for run in runs:
            head = run[0].meta
            parent = tree.root(head.parent) if head.position == 0 else nodes[head.parent]
            placements = _placements(run, by_key, pools)
            for pool, _, slots in placements:
                txn.adopt(pool, DISK, slots)
                used.update((pool, s) for s in slots)
            keys = [put.meta.key for put in run]
            tokens = b"".join(put.meta.tokens for put in run)
            nodes[keys[-1]] = txn.grow([], parent, keys, tokens, DISK, placements)[-1]
        left_out += [
            put for t in by_key.values() for put in t.values() if (put.pool, put.slot) not in used
        ]
    for pool in pools:
        slots = [put.slot for put in left_out if put.pool == pool]
        if slots:
            store.free(pool, slots)
    return Adopted(len(used), len(left_out))


def _runs(children: dict[bytes, list[Put]], pages: dict[bytes, Put]) -> list[list[Put]]:
    """The chains from position 0 as runs (a run ends where a page has no single child),
    parents before children."""
    stack = [put for put in pages.values() if put.meta.position == 0]
    out: list[list[Put]] = []
    while stack:
        run = [stack.pop()]
        while True:
            kids = _next(children, run[-1])
            if len(kids) != 1:
                break
            run.append(kids[0])
        out.append(run)
        stack.extend(_next(children, run[-1]))
    return out


def _next(children: dict[bytes, list[Put]], put: Put) -> list[Put]:
    """The pages that follow `put` (one position on: a chain only ever grows)."""
    return [c for c in children.get(put.meta.key, ()) if c.meta.position == put.meta.position + 1]


def _placements(
    run: list[Put], by_key: dict[PoolName, dict[bytes, Put]], pools: tuple[PoolName, ...]
) -> list[Placement]:
    """Per pool, the run's positions it has a page for on disk, and their slots."""
    out: list[Placement] = []
    for pool in pools:
        table = by_key[pool]
        have = [
            (put.meta.position, table[put.meta.key].slot)
            for put in run
            if put.meta.key in table and table[put.meta.key].meta.position == put.meta.position
        ]
        if have:
            out.append((pool, [p for p, _ in have], [s for _, s in have]))
    return out
