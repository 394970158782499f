"""The global prefix index: which node holds which page, from the nodes' KV events.

One process: an index shard wraps one, and the unsharded reference of the
differential tests is one. Its table (presence.py, C or pure Python by KVF_NATIVE)
keeps per page key every holder's mask as a code byte per node slot, which lookups
AND along a request's keys (what counts as a match is the layout's MatchRule, read
from its attention policies), and per node slot what it published of each page.
Node names, admission (epochs, sequence numbers) and validation stay here.
`apply_chain` takes what a node publishes after a put, a run of consecutive pages with
one mask: after validation and admission, one table call, with no object per page."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..cache.nodes import TIERS  # a Tier by its value (fastest first), with no enum call
from .admission import Admission, ApplyResult
from .answers import NodeMatch, rank_key
from .events import (
    _MAX_MASK,
    KEY_BYTES,
    MAX_DEPTH,
    EventBatch,
    EventError,
    PageState,
    Snapshot,
    check_header,
    check_pages,
)
from .match_rule import MatchRule
from .presence import new_presence

_make = tuple.__new__  # NodeMatch(fields) with no Python frame (answers.py)


@dataclass
class _NodeState:
    slot: int  # its pages are the table's under this slot
    epoch: int
    seq: int | None  # last applied batch; None: not in sync (needs seq 0, cleared or a snapshot)


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
        self._presence = new_presence(rule, native)
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
                self._presence.clear(st.slot)
            self._set_pages(st.slot, batch.pages)
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
        changes nothing), and the per-page work is the table's (C, or C-level passes).

        The common batch, the next of a node in sync, goes straight to the table, whose
        `set_chain` checks every argument itself (exact types, ValueError, nothing
        changed): its admission changes no state, so checking after it is as safe as
        before. Anything it refuses takes the full path below, which says what is wrong
        (or accepts an int subclass, such as a PageMask, the table's exact check does
        not)."""
        if (
            type(node) is str
            and (st := self._nodes.get(node)) is not None
            and st.seq is not None
            and type(seq) is int
            and seq == st.seq + 1
            and type(epoch) is int
            and epoch == st.epoch
            and cleared is False
            and type(keys) is list
            and self.admission.refuses(node, epoch) is None
        ):
            try:
                self._presence.set_chain(st.slot, keys, first_depth, parent, mask)
            except ValueError:  # refused, nothing changed: the full path below says why
                pass
            else:
                st.seq = seq
                self._counts[ApplyResult.APPLIED] += 1
                return ApplyResult.APPLIED
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
        try:
            self._presence.check(keys, parent)
        except ValueError as e:
            raise EventError(str(e)) from None
        fast = (
            type(first_depth) is int
            and 0 <= first_depth <= MAX_DEPTH - len(keys)
            and type(mask) is int
            and 0 <= mask <= _MAX_MASK
        )
        if not fast and (
            not isinstance(first_depth, int)
            or isinstance(first_depth, bool)
            or not 0 <= first_depth <= MAX_DEPTH - len(keys)
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
                self._presence.clear(st.slot)
            if keys:
                self._presence.set_chain(st.slot, keys, int(first_depth), parent, int(mask))
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
            self._presence.clear(st.slot)
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
        self._presence.clear(st.slot)
        self._set_pages(st.slot, snap.pages)
        st.epoch, st.seq = snap.epoch, snap.seq
        self._snapshots += 1
        return ApplyResult.APPLIED

    def drop_node(self, node: str) -> None:
        """Forget the node and refuse its events, late ones included, until `admit`."""
        self.admission.drop(node)
        st = self._nodes.pop(node, None)
        if st is None:
            return
        self._slots[st.slot] = None
        self._presence.close(st.slot)

    def retire(self, node: str, epoch: int) -> None:
        """Life `epoch` of `node` ended: what it published goes, its late events are
        refused, and unless a later life already publishes, its slot is free again."""
        check_header(node, epoch, 0)
        self.admission.retire(node, epoch)
        st = self._nodes.get(node)
        if st is not None and st.epoch <= epoch:
            del self._nodes[node]
            self._slots[st.slot] = None
            self._presence.close(st.slot)

    def admit(self, node: str, epoch: int) -> None:
        """The directory's word that `node` belongs, publishing from `epoch` on: a dropped
        node is accepted again, and what an older epoch of it published is gone."""
        check_header(node, epoch, 0)
        floor = self.admission.admit(node, epoch)
        st = self._nodes.get(node)
        if st is not None and st.epoch < floor:
            self._presence.clear(st.slot)
            st.epoch, st.seq = floor, None

    def _add_node(self, node: str, epoch: int) -> _NodeState:
        self.admission.alive(node)
        if None not in self._slots:  # reuse a dropped node's slot: ints stay short
            self._slots.append(None)
        slot = self._slots.index(None)
        self._slots[slot] = node
        self._presence.open(slot)
        st = self._nodes[node] = _NodeState(slot, epoch, None)
        return st

    def _set_pages(self, slot: int, pages: Sequence[PageState]) -> None:
        """Validated pages, in order, as chains: a run of consecutive pages with one mask
        is one table call (what a page states does not depend on how they are grouped)."""
        table, i, n = self._presence, 0, len(pages)
        while i < n:
            first = pages[i]
            j = i + 1
            while (
                j < n
                and pages[j].parent == pages[j - 1].key
                and pages[j].depth == pages[j - 1].depth + 1
                and pages[j].mask == first.mask
            ):
                j += 1
            keys = [p.key for p in pages[i:j]]
            table.set_chain(slot, keys, int(first.depth), first.parent, int(first.mask))
            i = j

    def lookup(self, keys: Sequence[bytes]) -> list[NodeMatch]:
        """Each node's usable match length for these chained page keys, best first."""
        if not keys:
            return []
        found, slots = self._presence.lookup(keys), self._slots
        if len(found) == 1:  # the common answer: no comprehension's frame, no sort
            s, n, t = found[0]
            return [_make(NodeMatch, (slots[s], n, TIERS[t]))]
        out = [_make(NodeMatch, (slots[s], n, TIERS[t])) for s, n, t in found]
        out.sort(key=rank_key)
        return out

    def node_pages(self, node: str) -> dict[bytes, PageState]:
        st = self._nodes.get(node)
        if st is None:
            return {}
        return {p[0]: PageState(*p) for p in self._presence.pages(st.slot)}

    def held_keys(self) -> list[bytes]:
        """Every key some node holds."""
        return self._presence.keys()

    def page_meta(self, key: bytes) -> tuple[bytes, int] | None:
        """(parent, depth) of a key some node holds, as last published."""
        if type(key) is not bytes or len(key) != KEY_BYTES:
            return None  # no such key is held
        return self._presence.meta(key)

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
            "slots": len(self._slots),  # open or free: a table's width
            "floors": len(self.admission),
            "node_pages": sum(map(self._presence.count, (st.slot for st in self._nodes.values()))),
            "out_of_sync": sorted(n for n, st in self._nodes.items() if st.seq is None),
            "dropped_nodes": self.admission.dropped(),
            "snapshots_loaded": self._snapshots,
            **{r.value: c for r, c in self._counts.items()},
        }
