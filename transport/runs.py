"""Page runs: (remote page, local page) pairs merged into one descriptor per stretch of
pages contiguous on *both* sides.

A READ costs about as much per descriptor as per byte for small pages (UCX posts one
get per descriptor), so pairs are ordered by remote page, which puts every run's pages
next to each other, and each run then moves as one descriptor. NIXL (>= 1.5) merges
adjacent prepared descriptors contiguous on both sides itself, from the page-indexed
lists prepared once per pool and peer; `merge_runs` is that merge written out: the model
that a read plan's descriptor count (base.py, or its C twin) and NIXL's own count (its
telemetry) are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Pool capacities up to this sort as uint16, where numpy's stable sort is a radix sort
# (~6x faster than on int64 at 1k pages); larger pools take the general sort.
_RADIX_MAX = 1 << 16


@dataclass(frozen=True)
class PageRuns:
    """Run i copies remote pages [remote[i], remote[i] + pages[i]) onto local pages
    [local[i], local[i] + pages[i])."""

    remote: np.ndarray  # int64, first remote page of each run
    local: np.ndarray  # int64, first local page of each run
    pages: np.ndarray  # int64, pages in each run (>= 1)

    def __len__(self) -> int:
        return len(self.pages)

    def byte_ranges(self, page_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(remote offset, local offset, length) in bytes of each run's descriptor."""
        return self.remote * page_bytes, self.local * page_bytes, self.pages * page_bytes


def order_pairs(remote: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs sorted by remote page (stably), so every run's pages are adjacent. The order
    of pairs within one READ does not matter, as local pages are distinct."""
    if len(remote) < 2:
        return remote, local
    key = remote.astype(np.uint16) if int(remote.max()) < _RADIX_MAX else remote
    order = np.argsort(key, kind="stable")
    return remote[order], local[order]


def run_starts(remote: np.ndarray, local: np.ndarray) -> np.ndarray:
    """Indices of the ordered pairs that start a run: the first pair, and each pair that
    does not continue the one before it on both sides."""
    head = np.ones(len(remote), dtype=np.bool_)
    if len(remote) > 1:  # slices rather than np.diff: a third of the cost at 64 pages
        np.not_equal(remote[1:], remote[:-1] + 1, out=head[1:])
        head[1:] |= local[1:] != local[:-1] + 1
    return np.flatnonzero(head)


def merge_runs(remote: np.ndarray, local: np.ndarray) -> PageRuns:
    """Runs of already ordered pairs (see `order_pairs`); they cover the same pages."""
    starts = run_starts(remote, local)
    pages = np.empty(len(starts), dtype=np.int64)
    pages[:-1] = starts[1:] - starts[:-1]
    pages[-1:] = len(remote) - starts[-1:]
    return PageRuns(
        remote[starts].astype(np.int64, copy=False),
        local[starts].astype(np.int64, copy=False),
        pages,
    )
