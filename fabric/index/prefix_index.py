"""The global prefix index: which node holds which page, from the nodes' KV events.

One process: an index shard wraps one, and the unsharded reference of the
differential tests is one. Per page key its presence table keeps every holder's mask
as a 4-bit nibble per node slot (see `_code`), which lookups AND along a request's
keys (see presence.py; what counts as a match is the layout's MatchRule, read from its
attention policies); the table is C or pure Python (KVF_NATIVE). Admission (epochs,
sequence numbers), validation, what each node published and page metadata stay here.
`apply_chain` takes what a node publishes after a put, a run of consecutive pages with
one mask, as one table call and dict updates, with no object per page (see `Chain`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import Sequence

from .admission import Admission, ApplyResult
from .answers import Chain, NodeMatch, rank_key, resolve
from .events import (
    _MAX_MASK,
    KEY_BYTES,
    EventBatch,
    EventError,
    PageMask,
    PageState,
    Snapshot,
    check_header,
    check_pages,
)
from .lookups import _BYTES, _KEY_LEN  # one definition of a well-formed key list
from .match_rule import MatchRule
from .presence import new_presence

# Bits of a node's nibble: FULL on either tier, FULL on device, SWA on either, SWA on device.
_F_ANY, _F_DEV, _S_ANY, _S_DEV = 1, 2, 4, 8


def _code(mask: int) -> int:
    """A PageMask as a nibble whose bits AND sensibly along a path: FULL_DEVICE then
    FULL_HOST still means "FULL on both", which ANDing raw masks would lose."""
    return (
        (_F_ANY if mask & PageMask.FULL else 0)
        | (_F_DEV if mask & PageMask.FULL_DEVICE else 0)
        | (_S_ANY if mask & PageMask.SWA else 0)
        | (_S_DEV if mask & PageMask.SWA_DEVICE else 0)
    )


_CODES = tuple(_code(m) for m in range(_MAX_MASK + 1))  # mask -> nibble, without enum arithmetic


@dataclass
class _NodeState:
    slot: int
    epoch: int
    seq: int | None  # last applied batch; None: not in sync (needs seq 0, cleared or a snapshot)
    # key -> the Chain this node last published it in (`node_pages` makes PageStates)
    pages: dict[bytes, Chain] = field(default_factory=dict)


class PrefixIndex:
    def __init__(
        self, rule: MatchRule, fingerprint: bytes | None = None, *, native: bool | None = None
    ) -> None:
        """`native`: the C presence table or the reference (default: KVF_NATIVE's pick)."""
        if not isinstance(rule, MatchRule):
            raise ValueError(f"rule must be a MatchRule, got {rule!r}")
        self.rule = rule
        self.window_pages, self.has_full = rule.window_pages, rule.has_full
        self.fingerprint = fingerprint  # if set, batches of another layout are refused
        # Key -> packed holders, kept apart from key -> (parent, depth) so that a lookup
        # reads only the packed nibbles.
        self._presence = new_presence(rule, native)
        self._meta: dict[bytes, Chain] = {}  # key -> the record it was last published in
        self._nodes: dict[str, _NodeState] = {}
        self._slots: list[str | None] = []  # slot -> node name; None: free
        # Dropped nodes and epoch floors, so that late events cannot resurrect a node.
        self.admission = Admission()
        self._counts = {r: 0 for r in ApplyResult}
        self._snapshots = 0

    # ---- events ----

    def apply(self, batch: EventBatch) -> ApplyResult:
        self._check_layout(batch.fingerprint)
        check_header(batch.node, batch.epoch, batch.seq)
        check_pages(batch.pages, allow_zero=True)
        result = self._admit(batch.node, batch.epoch, batch.seq, batch.cleared)
        if result is ApplyResult.APPLIED:
            st = self._nodes[batch.node]
            if batch.cleared:
                self._clear(st)
            for p in batch.pages:
                self._set(st, p.key, p.parent, p.depth, p.mask)
            st.seq = batch.seq
        self._counts[result] += 1
        return result

    def apply_chain(
        self,
        node: str,
        epoch: int,
        seq: int,
        keys: Sequence[bytes],
        first_depth: int,
        parent: bytes,
        mask: int,
        cleared: bool = False,
    ) -> ApplyResult:
        """Batch `seq` of `node` stating one chain of consecutive pages, all with `mask`:
        what a node publishes after a put (mask > 0) or an eviction of a suffix (mask 0).

        The same as `apply(EventBatch(node, epoch, seq, pages, cleared))` where page i is
        `PageState(keys[i], keys[i - 1] if i else parent, first_depth + i, mask)`: the same
        admission rules (seq order, epochs, gaps, cleared), the same result and state, but
        without a PageState per page. Arguments are validated in bulk before anything is
        applied (keys: exact `bytes` of KEY_BYTES each; bad input raises EventError and
        changes nothing), and the per-page work is a few C-level passes over the keys."""
        if not (
            type(node) is str
            and node
            and type(epoch) is int
            and epoch >= 0
            and type(seq) is int
            and seq >= 0
        ):
            check_header(node, epoch, seq)  # the full check: subclasses, or raises
        if type(keys) is not list:
            if isinstance(keys, (str, bytes, bytearray, memoryview)) or not hasattr(
                keys, "__iter__"
            ):
                raise EventError(f"keys must be a sequence of {KEY_BYTES}-byte bytes")
            keys = list(keys)
        if keys and (set(map(type, keys)) != _BYTES or set(map(len, keys)) != _KEY_LEN):
            raise EventError(f"chain keys must be {KEY_BYTES}-byte bytes")
        if type(parent) is not bytes or len(parent) != KEY_BYTES:
            raise EventError(f"chain parent must be {KEY_BYTES} bytes")
        fast = (
            type(first_depth) is int
            and first_depth >= 0
            and type(mask) is int
            and 0 <= mask <= _MAX_MASK
        )
        if not fast and (
            not isinstance(first_depth, int)
            or isinstance(first_depth, bool)
            or first_depth < 0
            or not isinstance(mask, int)
            or isinstance(mask, bool)
            or not 0 <= mask <= _MAX_MASK
        ):
            raise EventError(f"bad first_depth {first_depth!r} or mask {mask!r}")
        if type(cleared) is not bool:
            raise EventError(f"cleared must be a bool, got {cleared!r}")
        result = self._admit(node, epoch, seq, cleared)
        if result is ApplyResult.APPLIED:
            st = self._nodes[node]
            if cleared:
                self._clear(st)
            if keys:
                self._set_chain(st, keys, first_depth, parent, int(mask))
            st.seq = seq
        self._counts[result] += 1
        return result

    def _admit(self, node: str, epoch: int, seq: int, cleared: bool) -> ApplyResult:
        """Decide what a batch means for its node's state; may reset that state."""
        refused = self.admission.refuses(node, epoch)
        if refused is not None:
            return refused
        st = self._nodes.get(node)
        if st is None:
            st = self._add_node(node, epoch)
        if epoch < st.epoch:
            return ApplyResult.STALE_EPOCH
        if epoch > st.epoch:  # the node restarted: what it published before is gone
            self._clear(st)
            st.epoch, st.seq = epoch, None
        if st.seq is not None and seq <= st.seq:
            return ApplyResult.DUPLICATE
        # A cleared batch states the node's whole contents, so it is safe after any gap.
        if cleared or seq == (0 if st.seq is None else st.seq + 1):
            return ApplyResult.APPLIED
        return ApplyResult.NEED_SNAPSHOT

    def _check_layout(self, fingerprint: bytes) -> None:
        if self.fingerprint is not None and fingerprint != self.fingerprint:
            raise EventError("events from a node of another model layout (fingerprint differs)")

    def load_snapshot(self, snap: Snapshot) -> ApplyResult:
        """Replace the node's whole state. A snapshot older than what the index already
        applied (older epoch, or earlier seq of the same epoch) is ignored and says so."""
        self._check_layout(snap.fingerprint)
        check_header(snap.node, snap.epoch, snap.seq)
        check_pages(snap.pages, allow_zero=False)
        refused = self.admission.refuses(snap.node, snap.epoch)
        if refused is not None:
            return refused
        st = self._nodes.get(snap.node)
        epoch, seq = (st.epoch, st.seq) if st else (-1, None)
        if snap.epoch < epoch:
            return ApplyResult.STALE_EPOCH
        if snap.epoch == epoch and seq is not None and snap.seq < seq:
            return ApplyResult.DUPLICATE
        if st is None:
            st = self._add_node(snap.node, snap.epoch)
        self._clear(st)
        for p in snap.pages:
            self._set(st, p.key, p.parent, p.depth, p.mask)
        st.epoch, st.seq = snap.epoch, snap.seq
        self._snapshots += 1
        return ApplyResult.APPLIED

    def drop_node(self, node: str) -> None:
        """Forget the node and refuse its events, late ones included, until `admit`."""
        self.admission.drop(node)
        st = self._nodes.pop(node, None)
        if st is None:
            return
        self._clear(st)
        self._slots[st.slot] = None
        self._presence.close(st.slot)

    def admit(self, node: str, epoch: int) -> None:
        """The directory's word that `node` belongs, publishing from `epoch` on: a dropped
        node is accepted again, and what an older epoch of it published is gone."""
        check_header(node, epoch, 0)
        floor = self.admission.admit(node, epoch)
        st = self._nodes.get(node)
        if st is not None and st.epoch < floor:
            self._clear(st)
            st.epoch, st.seq = floor, None

    def _add_node(self, node: str, epoch: int) -> _NodeState:
        if None not in self._slots:  # reuse a dropped node's slot: ints stay short
            self._slots.append(None)
        slot = self._slots.index(None)
        self._slots[slot] = node
        self._presence.open(slot)
        st = self._nodes[node] = _NodeState(slot, epoch, None)
        return st

    def _set(self, st: _NodeState, key: bytes, parent: bytes, depth: int, mask: int) -> None:
        if mask:
            st.pages[key] = self._meta[key] = ((key,), depth, parent, mask)
            self._presence.set(st.slot, (key,), _CODES[mask])
        else:
            st.pages.pop(key, None)
            self._forget(self._presence.set(st.slot, (key,), 0))

    def _set_chain(
        self, st: _NodeState, keys: list[bytes], first_depth: int, parent: bytes, mask: int
    ) -> None:
        """`_set` for every page of a chain: one table call and C-level dict updates."""
        if not mask:
            for key in keys:
                st.pages.pop(key, None)
            self._forget(self._presence.set(st.slot, keys, 0))
            return
        self._presence.set(st.slot, keys, _CODES[mask])
        rec = (tuple(keys), first_depth, parent, mask)
        st.pages.update(zip(keys, repeat(rec)))
        self._meta.update(zip(keys, repeat(rec)))

    def _clear(self, st: _NodeState) -> None:
        if not st.pages:
            return
        self._forget(self._presence.set(st.slot, list(st.pages), 0))
        st.pages = {}

    def _forget(self, removed: list[bytes] | None) -> None:
        """Drop the records of keys no node holds any more."""
        for key in removed or ():
            del self._meta[key]

    def lookup(self, keys: Sequence[bytes]) -> list[NodeMatch]:
        """Each node's usable match length for these chained page keys, best first."""
        if not keys:
            return []
        slots = self._slots
        out = [NodeMatch(slots[s], n, d) for s, n, d in self._presence.lookup(keys)]  # type: ignore[arg-type]
        if len(out) > 1:
            out.sort(key=rank_key)
        return out

    def node_pages(self, node: str) -> dict[bytes, PageState]:
        st = self._nodes.get(node)
        if st is None:
            return {}
        pages, found = st.pages, {}
        for rec in {id(r): r for r in pages.values()}.values():  # each record once: O(pages)
            keys, depth, parent, mask = rec
            for i, k in enumerate(keys):
                if pages.get(k) is rec:
                    found[k] = PageState(k, keys[i - 1] if i else parent, depth + i, mask)
        return {k: found[k] for k in pages}

    def held_keys(self) -> list[bytes]:
        """Every key some node holds."""
        return self._presence.keys()

    def page_meta(self, key: bytes) -> tuple[bytes, int] | None:
        """(parent, depth) of a key some node holds, as last published."""
        rec = self._meta.get(key)
        return None if rec is None else resolve(key, rec)[:2]

    def sync_point(self, node: str) -> tuple[int, int | None] | None:
        """(epoch, last applied seq) of a tracked node; seq None while it needs a snapshot."""
        st = self._nodes.get(node)
        return None if st is None else (st.epoch, st.seq)

    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    def __len__(self) -> int:
        return len(self._presence)

    def stats(self) -> dict:
        return {
            "keys": len(self._presence),
            "nodes": len(self._nodes),
            "node_pages": sum(len(st.pages) for st in self._nodes.values()),
            "out_of_sync": sorted(n for n, st in self._nodes.items() if st.seq is None),
            "dropped_nodes": self.admission.dropped(),
            "snapshots_loaded": self._snapshots,
            **{r.value: c for r, c in self._counts.items()},
        }
