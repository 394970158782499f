"""The global prefix index: which node holds which page, from the nodes' KV events.

Plain Python, one process: an index shard wraps one, and the unsharded reference
of the differential tests is one. Per page key it keeps every holder's mask packed
in one int, a 4-bit nibble per node slot (see `_code`), so that the running AND of
the ints along a request's keys says, for all nodes at once, which hold every page
so far, in which pool and tier. A lookup does its per-page work in C iterators;
Python-level work is per distinct match length, not per page or node."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import reduce
from itertools import accumulate, count, repeat, takewhile
from operator import and_
from typing import Sequence

from fabric.events import KEY_BYTES, EventBatch, EventError, PageMask, PageState, Snapshot

# Bits of a node's nibble: FULL on either tier, FULL on device, SWA on either, SWA on device.
_F_ANY, _F_DEV, _S_ANY, _S_DEV = 1, 2, 4, 8
_MAX_MASK = int(PageMask.FULL | PageMask.SWA)


def _code(mask: int) -> int:
    """A PageMask as a nibble whose bits AND sensibly along a path: FULL_DEVICE then
    FULL_HOST still means "FULL on both", which ANDing raw masks would lose."""
    return ((_F_ANY if mask & PageMask.FULL else 0) | (_F_DEV if mask & PageMask.FULL_DEVICE else 0)
            | (_S_ANY if mask & PageMask.SWA else 0) | (_S_DEV if mask & PageMask.SWA_DEVICE else 0))


@dataclass(frozen=True)
class NodeMatch:
    node: str
    pages: int          # usable match length in pages on that node
    device: bool        # True if every page that match needs is on the node's DEVICE tier


class ApplyResult(Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    STALE_EPOCH = "stale_epoch"
    NEED_SNAPSHOT = "need_snapshot"


@dataclass
class _NodeState:
    slot: int
    epoch: int
    seq: int | None     # last applied batch; None: not in sync (needs seq 0, cleared or a snapshot)
    pages: dict[bytes, PageState] = field(default_factory=dict)


class PrefixIndex:
    def __init__(self, window_pages: int, has_full: bool = True) -> None:
        if not isinstance(window_pages, int) or isinstance(window_pages, bool) or window_pages < 0:
            raise ValueError(f"window_pages must be an int >= 0, got {window_pages!r}")
        if not has_full and window_pages == 0:
            raise ValueError("a layout with neither full nor SWA layers has nothing to match")
        self.window_pages = window_pages
        self.has_full = bool(has_full)
        # Key -> packed holders (never 0: a key no node holds is deleted), kept apart from
        # key -> (parent, depth) so that a lookup reads plain ints at C speed.
        self._bits: dict[bytes, int] = {}
        self._meta: dict[bytes, tuple[bytes, int]] = {}
        self._nodes: dict[str, _NodeState] = {}
        self._slots: list[str | None] = []        # slot -> node name; None: free
        self._ones = 0                            # bit 0 of every slot's nibble
        # (epoch, seq) of dropped nodes, so their late batches cannot resurrect them.
        self._retired: dict[str, tuple[int, int | None]] = {}
        self._counts = {r: 0 for r in ApplyResult}
        self._snapshots = 0

    # ---- events ----

    def apply(self, batch: EventBatch) -> ApplyResult:
        _check_header(batch.node, batch.epoch, batch.seq)
        _check_pages(batch.pages, allow_zero=True)
        result = self._admit(batch)
        if result is ApplyResult.APPLIED:
            st = self._nodes[batch.node]
            if batch.cleared:
                self._clear(st)
            for p in batch.pages:
                self._set(st, p)
            st.seq = batch.seq
        self._counts[result] += 1
        return result

    def _admit(self, b: EventBatch) -> ApplyResult:
        """Decide what a batch means for its node's state; may reset that state."""
        st = self._nodes.get(b.node)
        if st is None:
            old_epoch, old_seq = self._retired.get(b.node, (-1, None))
            if b.epoch < old_epoch:
                return ApplyResult.STALE_EPOCH
            if b.epoch == old_epoch and old_seq is not None and b.seq <= old_seq:
                return ApplyResult.DUPLICATE
            st = self._add_node(b.node, b.epoch)
        if b.epoch < st.epoch:
            return ApplyResult.STALE_EPOCH
        if b.epoch > st.epoch:            # the node restarted: what it published before is gone
            self._clear(st)
            st.epoch, st.seq = b.epoch, None
        if st.seq is not None and b.seq <= st.seq:
            return ApplyResult.DUPLICATE
        # A cleared batch states the node's whole contents, so it is safe after any gap.
        if b.cleared or b.seq == (0 if st.seq is None else st.seq + 1):
            return ApplyResult.APPLIED
        return ApplyResult.NEED_SNAPSHOT

    def load_snapshot(self, snap: Snapshot) -> ApplyResult:
        """Replace the node's whole state. A snapshot older than what the index already
        applied (older epoch, or earlier seq of the same epoch) is ignored and says so."""
        _check_header(snap.node, snap.epoch, snap.seq)
        _check_pages(snap.pages, allow_zero=False)
        st = self._nodes.get(snap.node)
        epoch, seq = (st.epoch, st.seq) if st else self._retired.get(snap.node, (-1, None))
        if snap.epoch < epoch:
            return ApplyResult.STALE_EPOCH
        if snap.epoch == epoch and seq is not None and snap.seq < seq:
            return ApplyResult.DUPLICATE
        if st is None:
            st = self._add_node(snap.node, snap.epoch)
        self._clear(st)
        for p in snap.pages:
            self._set(st, p)
        st.epoch, st.seq = snap.epoch, snap.seq
        self._snapshots += 1
        return ApplyResult.APPLIED

    def drop_node(self, node: str) -> None:
        st = self._nodes.pop(node, None)
        if st is None:
            return
        self._clear(st)
        self._retired[node] = (st.epoch, st.seq)
        self._slots[st.slot] = None
        self._ones &= ~(1 << 4 * st.slot)

    def _add_node(self, node: str, epoch: int) -> _NodeState:
        self._retired.pop(node, None)
        if None not in self._slots:       # reuse a dropped node's slot: ints stay short
            self._slots.append(None)
        slot = self._slots.index(None)
        self._slots[slot] = node
        self._ones |= 1 << 4 * slot
        st = self._nodes[node] = _NodeState(slot, epoch, None)
        return st

    def _set(self, st: _NodeState, p: PageState) -> None:
        shift = 4 * st.slot
        bits = (self._bits.get(p.key, 0) & ~(0xF << shift)) | (_code(p.mask) << shift)
        if p.mask:
            st.pages[p.key] = p
            self._bits[p.key] = bits
            self._meta[p.key] = (p.parent, p.depth)
        else:
            st.pages.pop(p.key, None)
            self._store(p.key, bits)

    def _clear(self, st: _NodeState) -> None:
        keep = ~(0xF << 4 * st.slot)
        for key in st.pages:
            self._store(key, self._bits[key] & keep)
        st.pages = {}

    def _store(self, key: bytes, bits: int) -> None:
        if bits:
            self._bits[key] = bits
        elif self._bits.pop(key, None) is not None:
            del self._meta[key]

    # ---- queries ----

    def lookup(self, keys: Sequence[bytes]) -> list[NodeMatch]:
        """Each node's usable match length for these chained page keys, best first."""
        if not keys:
            return []
        if set(map(type, keys)) != {bytes} or set(map(len, keys)) != {KEY_BYTES}:
            raise ValueError(f"lookup keys must be {KEY_BYTES}-byte bytes")
        chain, prefix = self._walk(keys)
        if not chain:
            return []
        out: list[NodeMatch] = []
        pending = 0 if self.has_full else self._ones   # without FULL runs, all scan from the end
        for n, group in self._full_runs(prefix) if self.has_full else ():
            pending |= self._match_group(chain, prefix, n, group, out)
        if pending:
            self._fall_back(chain, prefix, pending, out)
        out.sort(key=lambda m: (-m.pages, not m.device, m.node))
        return out

    def _walk(self, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """The packed holders of each page a match may reach, and their running AND from
        page 0; C-level iterators, as this is most of a lookup's work."""
        if self.has_full:     # stop at the first key no node holds (held keys have bits != 0)
            chain = list(takewhile(bool, map(self._bits.get, keys)))
        else:                 # without full layers only a window must be held: no stopping early
            chain = list(map(self._bits.get, keys, repeat(0)))
        return chain, list(accumulate(chain, and_))

    def _full_runs(self, prefix: list[int]) -> list[tuple[int, int]]:
        """(F, nodes whose FULL run from page 0 is exactly F pages). The running AND only
        loses bits, so each distinct value is one run: the work is per run, not per page."""
        ends = dict(zip(prefix, count(1)))         # each run's value -> its end, in one C pass
        ones, runs, inner = self._ones, [], 0
        for v in reversed(ends):
            held = v & ones
            if held & ~inner:
                runs.append((ends[v], held & ~inner))
            inner = held
        return runs

    def _match_group(self, chain: list[int], prefix: list[int], n: int, group: int,
                     out: list[NodeMatch]) -> int:
        """Nodes that may match up to n pages: those holding the SWA window there match n;
        the others are returned, for `_fall_back`."""
        w, win = self.window_pages, -1
        if w:
            win = prefix[n - 1] if n <= w else reduce(and_, chain[n - w:n])
        ok = group & (win >> 2)
        self._emit(ok, n, (prefix[n - 1] >> 1 if self.has_full else -1) & (win >> 3), out)
        return group & ~ok

    def _fall_back(self, chain: list[int], prefix: list[int], pending: int, out: list[NodeMatch]) -> None:
        """Nodes whose SWA window fails where their match could end (a tombstoned prefix the
        request leaves early, say): try shorter lengths, all such nodes in one downward scan."""
        wins, full = self._windows(chain, prefix), self.has_full
        for m in range(len(chain), 0, -1):
            hits = pending & (wins[m - 1] >> 2) & (prefix[m - 1] if full else -1)
            if hits:
                self._emit(hits, m, (prefix[m - 1] >> 1 if full else -1) & (wins[m - 1] >> 3), out)
                pending ^= hits
                if not pending:
                    return

    def _windows(self, chain: list[int], prefix: list[int]) -> list[int]:
        """wins[m - 1] = AND of chain over the window [max(0, m - W), m), for every m: ANDs
        over runs of 1, 2, 4.. pages by doubling, then two overlapping runs per window."""
        w, n = self.window_pages, len(chain)
        if w >= n:
            return prefix
        runs, k = chain, 1
        while 2 * k <= w:
            runs, k = list(map(and_, runs, runs[k:])), 2 * k
        return prefix[:w - 1] + list(map(and_, runs, runs[w - k:]))

    def _emit(self, nodes: int, n: int, device: int, out: list[NodeMatch]) -> None:
        slots = self._slots
        while nodes:
            low = nodes & -nodes
            nodes ^= low
            out.append(NodeMatch(slots[(low.bit_length() - 1) >> 2], n, bool(device & low)))

    def node_pages(self, node: str) -> dict[bytes, PageState]:
        st = self._nodes.get(node)
        return dict(st.pages) if st is not None else {}

    def page_meta(self, key: bytes) -> tuple[bytes, int] | None:
        """(parent, depth) of a key some node holds, as last published."""
        return self._meta.get(key)

    def sync_point(self, node: str) -> tuple[int, int | None] | None:
        """(epoch, last applied seq) of a tracked node; seq None while it needs a snapshot."""
        st = self._nodes.get(node)
        return None if st is None else (st.epoch, st.seq)

    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    def __len__(self) -> int:
        return len(self._bits)

    def stats(self) -> dict:
        return {"keys": len(self._bits), "nodes": len(self._nodes),
                "node_pages": sum(len(st.pages) for st in self._nodes.values()),
                "out_of_sync": sorted(n for n, st in self._nodes.items() if st.seq is None),
                "snapshots_loaded": self._snapshots,
                **{r.value: c for r, c in self._counts.items()}}


def _check_header(node: object, epoch: object, seq: object) -> None:
    if not isinstance(node, str) or not node:
        raise EventError("node must be a non-empty str")
    for name, v in (("epoch", epoch), ("seq", seq)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise EventError(f"{name} must be an int >= 0, got {v!r}")


def _check_pages(pages: Sequence[PageState], allow_zero: bool) -> None:
    """Whole-batch validation before any of it is applied: bad input changes nothing."""
    for i, p in enumerate(pages):
        if not (isinstance(p, PageState) and type(p.key) is bytes and len(p.key) == KEY_BYTES
                and type(p.parent) is bytes and len(p.parent) == KEY_BYTES):
            raise EventError(f"page {i}: key and parent must be {KEY_BYTES} bytes")
        if not isinstance(p.depth, int) or p.depth < 0 or not isinstance(p.mask, int) \
                or not (0 if allow_zero else 1) <= p.mask <= _MAX_MASK:
            raise EventError(f"page {i}: bad depth {p.depth!r} or mask {p.mask!r}")
