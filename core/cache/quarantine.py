"""Pages an abandoned transfer may still write: kept out of use until it is known over."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from .layout import PoolName, Tier
from .pools import PoolRegistry


@dataclass
class Quarantine:
    """Pages an abandoned transfer from `peer` may still write: held until that
    peer is known dead or a later read from it completes (never by time alone)."""

    since: float
    peer: str | None
    pages: dict[tuple[PoolName, Tier], list[int]]


class Quarantines:
    """The quarantined pages of one cache's pools, by the peer whose transfer may write them."""

    def __init__(self, registry: PoolRegistry, clock: Callable[[], float]) -> None:
        self.registry = registry
        self.clock = clock
        self.held: list[Quarantine] = []

    def add(self, pages: dict[tuple[PoolName, Tier], list[int]], peer: str | None = None) -> None:
        """Keep pages out of use: an abandoned transfer from `peer` may still write them.
        No time releases them (a stopped peer resumes when it likes): only `release`,
        once the peer is dead or its transport says every read from it that was given
        up has completed (Transport.drained)."""
        self.held.append(Quarantine(self.clock(), peer, pages))

    def holds(self, peer: str) -> bool:
        """Whether pages an abandoned transfer from `peer` may still write are held."""
        return any(q.peer == peer for q in self.held)

    def peers(self) -> set[str]:
        return {q.peer for q in self.held if q.peer is not None}

    def release(self, peer: str | None = None, force: bool = False) -> int:
        """Free the pages quarantined for `peer`: it is dead, or the reads that may
        still write them have completed (Transport.drained). `force` frees all (tests,
        shutdown). Returns pages freed."""
        keep, freed = [], 0
        for q in self.held:
            if force or (peer is not None and q.peer == peer):
                for (pool, tier), indices in q.pages.items():
                    self.registry.pool(pool, tier).allocator.free(indices)
                    freed += len(indices)
            else:
                keep.append(q)
        self.held = keep
        return freed

    def __iter__(self) -> Iterator[Quarantine]:
        return iter(self.held)
