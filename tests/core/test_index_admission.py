"""Index admission: epochs, drops and rejoins against late, duplicated and reordered
messages. A dropped node stays dropped until the directory admits it again, and
an index never shows a node's pages from an epoch older than the admitted one."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvfabric.core.index.events import EventBatch, PageState, Snapshot
from kvfabric.core.index.match_rule import MatchRule
from kvfabric.core.index.prefix_index import ApplyResult as R
from kvfabric.core.index.prefix_index import PrefixIndex

from tests.core.test_index import KEYS, PAGES, batch
from tests.examples import examples

NODES = ("a", "b", "c")


def test_a_dropped_node_stays_dropped_whatever_arrives_late():
    ix = PrefixIndex(MatchRule(1))
    assert ix.apply(batch("a", 5, 0, PAGES[:2], cleared=True)) is R.APPLIED
    assert ix.apply(batch("a", 5, 1, PAGES[2:4])) is R.APPLIED
    ix.drop_node("a")
    late = batch("a", 5, 2, PAGES[4:])  # sent before the node died, delivered after the drop
    assert ix.apply(late) is R.DROPPED
    assert ix.load_snapshot(Snapshot("a", 5, 2, PAGES)) is R.DROPPED
    assert ix.load_snapshot(Snapshot("a", 6, 0, PAGES)) is R.DROPPED  # a newer epoch neither
    assert ix.apply_chain("a", 9, 0, KEYS, 0, PAGES[0].parent, 15, cleared=True) is R.DROPPED
    assert ix.nodes() == [] and ix.lookup(KEYS) == [] and len(ix) == 0
    ix.admit("a", 7)  # the directory rejoined it, publishing at epoch 7
    assert ix.apply(batch("a", 6, 0, PAGES, cleared=True)) is R.STALE_EPOCH
    assert ix.load_snapshot(Snapshot("a", 5, 9, PAGES)) is R.STALE_EPOCH
    assert ix.apply(batch("a", 7, 0, PAGES[:1], cleared=True)) is R.APPLIED
    assert [(m.node, m.pages) for m in ix.lookup(KEYS)] == [("a", 1)]


def test_admitting_a_newer_epoch_forgets_the_old_one_at_once():
    ix = PrefixIndex(MatchRule(1))
    ix.apply(batch("b", 1, 0, PAGES, cleared=True))
    ix.admit("b", 2)  # Ray restarted it; nothing of epoch 1 survives
    assert ix.node_pages("b") == {} and ix.sync_point("b") == (2, None) and ix.lookup(KEYS) == []
    assert ix.apply(batch("b", 1, 1, PAGES)) is R.STALE_EPOCH
    ix.admit("b", 1)  # a late, lower admission lowers nothing
    assert ix.apply(batch("b", 1, 1, PAGES)) is R.STALE_EPOCH
    assert ix.apply(batch("b", 2, 0, PAGES[:3], cleared=True)) is R.APPLIED
    assert set(ix.node_pages("b")) == set(KEYS[:3])


@dataclass
class Incarnation:
    """One life of a node identity, as the node itself sees it."""

    epoch: int
    seq: int = 0
    truth: dict[bytes, PageState] = field(default_factory=dict)
    history: list[dict[bytes, PageState]] = field(default_factory=list)  # state after batch i
    attached: bool = False  # admitted by the directory: it publishes


class AdmissionMachine(RuleBasedStateMachine):
    """Nodes publish, die, restart and rejoin; every message can arrive late, twice or
    never. The model is each node's own history: what the index shows of an admitted
    node is its state after some batch of its current epoch, and once every message is
    delivered and each node has sent a snapshot, exactly its state now."""

    def __init__(self) -> None:
        super().__init__()
        self.ix = PrefixIndex(MatchRule(2))
        self.epochs = 0  # the epoch source: strictly increasing, no clock
        self.life = {n: Incarnation(self._epoch()) for n in NODES}
        self.alive = {n: True for n in NODES}
        self.dropped = {n: False for n in NODES}
        self.inflight: list[EventBatch | Snapshot] = []

    def _epoch(self) -> int:
        self.epochs += 1
        return self.epochs

    @rule(
        node=st.sampled_from(NODES),
        picks=st.lists(st.tuples(st.integers(0, len(PAGES) - 1), st.integers(0, 15)), max_size=4),
    )
    def change(self, node, picks):
        life = self.life[node]
        if not (self.alive[node] and life.attached):
            return
        states = []
        for i, mask in picks:
            p = PAGES[i]
            state = PageState(p.key, p.parent, p.depth, mask)
            if mask:
                life.truth[p.key] = state
            else:
                life.truth.pop(p.key, None)
            states.append(state)
        self.inflight.append(batch(node, life.epoch, life.seq, states, cleared=life.seq == 0))
        life.seq += 1
        life.history.append(dict(life.truth))

    @rule(node=st.sampled_from(NODES))
    def send_snapshot(self, node):
        life = self.life[node]
        if self.alive[node] and life.attached and life.seq:
            self.inflight.append(
                Snapshot(node, life.epoch, life.seq - 1, tuple(life.truth.values()))
            )

    @precondition(lambda self: self.inflight)
    @rule(data=st.data())
    def deliver(self, data):
        i = data.draw(st.integers(0, len(self.inflight) - 1))
        msg = (
            self.inflight[i] if data.draw(st.booleans()) else self.inflight.pop(i)
        )  # or again later
        self._apply(msg)

    @precondition(lambda self: self.inflight)
    @rule(data=st.data())
    def lose(self, data):
        self.inflight.pop(data.draw(st.integers(0, len(self.inflight) - 1)))

    @rule(node=st.sampled_from(NODES))
    def restart(self, node):
        """Ray restarts the actor under the same identity: a new epoch, empty, not attached."""
        if self.alive[node]:
            self.life[node] = Incarnation(self._epoch())

    @rule(node=st.sampled_from(NODES))
    def die(self, node):
        self.alive[node] = False
        self.life[node].attached = False

    @rule(node=st.sampled_from(NODES))
    def directory_drops(self, node):
        if not self.alive[node] and not self.dropped[node]:
            self.ix.drop_node(node)
            self.dropped[node] = True

    @rule(node=st.sampled_from(NODES))
    def revive(self, node):
        """A new actor under the identity (the watcher placed one on the node again)."""
        if not self.alive[node] and self.dropped[node]:
            self.alive[node] = True
            self.life[node] = Incarnation(self._epoch())

    @rule(node=st.sampled_from(NODES))
    def rejoin(self, node):
        """The directory admits the new incarnation before attaching it to the index."""
        life = self.life[node]
        if self.alive[node] and not life.attached:
            self.ix.admit(node, life.epoch)
            life.attached, self.dropped[node] = True, False

    @rule(data=st.data())
    def settle(self, data):
        order = data.draw(st.permutations(range(len(self.inflight))))
        for i in order:
            self._apply(self.inflight[i])
        self.inflight = []
        for node, life in self.life.items():
            if self.alive[node] and life.attached and life.seq:
                self._apply(Snapshot(node, life.epoch, life.seq - 1, tuple(life.truth.values())))
        for node, life in self.life.items():
            if self.alive[node] and life.attached:
                assert self.ix.node_pages(node) == life.truth, node

    def _apply(self, msg) -> None:
        result = self.ix.apply(msg) if isinstance(msg, EventBatch) else self.ix.load_snapshot(msg)
        assert isinstance(result, R)

    @invariant()
    def dropped_nodes_are_gone(self):
        for node in NODES:
            if self.dropped[node]:
                assert node not in self.ix.nodes() and self.ix.node_pages(node) == {}, node

    @invariant()
    def admitted_nodes_show_a_state_of_their_current_epoch(self):
        for node, life in self.life.items():
            sync = self.ix.sync_point(node)
            if not (self.alive[node] and life.attached) or sync is None:
                continue
            epoch, seq = sync
            assert epoch == life.epoch, (node, sync, life.epoch)
            want = {} if seq is None else life.history[seq]
            assert self.ix.node_pages(node) == want, (node, sync)


AdmissionMachine.TestCase.settings = settings(
    max_examples=examples(150), stateful_step_count=40, deadline=None
)
test_admission_against_the_model = AdmissionMachine.TestCase
