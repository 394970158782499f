"""ShardBatches: one publisher's event batches, numbered per index shard.

A publisher (a node's cache, or an engine's pages) tells each shard only of the pages
whose key paths route there; each shard hears its own sequence 0, 1, 2... from it, and
the first batch a shard gets says `cleared`. The publishers differ only in how they
walk their pages: they hand this class (state, key path) pairs."""

from __future__ import annotations

from typing import Iterable

from .events import EventBatch, PageState, Snapshot
from .routes import RouteTable

Routed = Iterable[tuple[PageState, list[bytes]]]  # a page's state and its key path from depth 0


class ShardBatches:
    def __init__(self, node: str, epoch: int, fingerprint: bytes) -> None:
        self.node, self.epoch, self.fingerprint = node, epoch, fingerprint
        self.shard_seq: dict[int, int] = {}

    def changes(
        self, routes: RouteTable, changed: Routed, every_shard: bool = False
    ) -> dict[int, EventBatch]:
        """One batch per shard that must hear of a changed page; with `every_shard`,
        shards with no news get an empty batch (a heartbeat), as does each shard that
        has not had its first batch."""
        per_shard: dict[int, list[PageState]] = {}
        for state, path in changed:
            for shard in routes.shards_for(path):
                per_shard.setdefault(shard, []).append(state)
        for shard in range(routes.shards):
            if every_shard or shard not in self.shard_seq:
                per_shard.setdefault(shard, [])
        return {shard: self._next(shard, pages) for shard, pages in per_shard.items()}

    def restatement(self, routes: RouteTable, held: Routed) -> dict[int, EventBatch]:
        """Every shard's whole share of `held` as its next batch, `cleared`."""
        return {
            shard: self._next(shard, list(snap.pages), cleared=True)
            for shard, snap in self.snapshots(routes, held).items()
        }

    def snapshots(self, routes: RouteTable, held: Routed) -> dict[int, Snapshot]:
        """What each shard should hold of `held` (pages with a mask), each as of the last
        batch that shard got."""
        per_shard: dict[int, list[PageState]] = {s: [] for s in range(routes.shards)}
        for state, path in held:
            if state.mask:
                for shard in routes.shards_for(path):
                    per_shard[shard].append(state)
        return {
            s: Snapshot(
                self.node, self.epoch, self.shard_seq.get(s, 0) - 1, tuple(pages), self.fingerprint
            )
            for s, pages in per_shard.items()
        }

    def _next(self, shard: int, pages: list[PageState], cleared: bool = False) -> EventBatch:
        seq = self.shard_seq.get(shard, 0)
        self.shard_seq[shard] = seq + 1
        return EventBatch(
            self.node,
            self.epoch,
            seq,
            tuple(pages),
            cleared=cleared or seq == 0,
            fingerprint=self.fingerprint,
        )
