"""The directory's replication (actors/replicas.py) without Ray: reports of committed
fetches in, copies out (the target pulls from a holder), a failed copy gives its budget
back, the reader of the fetch that made a prefix hot is not a target."""

from __future__ import annotations

from kvfabric.actors.replicas import COMMITTED, FetchReport, ReplicaDirector
from kvfabric.core.index.replication import ReplicationConfig

PAGE = 2
TOKENS = tuple(range(10))  # 5 pages
KEYS = tuple(f"k{i}".encode() for i in range(5))


class Fabric:
    def __init__(self) -> None:
        self.held = {"a": set(KEYS), "b": set(), "c": set(), "d": set()}
        self.copies: list[tuple] = []
        self.now = 0.0

    def holders(self, keys):
        return [n for n, ks in self.held.items() if keys[-1] in ks]

    def copy(self, target, source, tokens, namespace, done):
        self.copies.append((target, source, tokens, namespace, done))


def director(fabric: Fabric, **kw) -> ReplicaDirector:
    d = ReplicaDirector(
        ReplicationConfig(**kw), PAGE, fabric.holders, fabric.copy, clock=lambda: fabric.now
    )
    for n in fabric.held:
        d.join(n, 100)
    return d


def report(reader: str, pages: int = 5) -> FetchReport:
    return FetchReport("a", reader, "ns", TOKENS[: pages * PAGE], KEYS[:pages])


def test_reports_over_the_threshold_start_copies_of_the_prefix_to_the_others():
    f = Fabric()
    d = director(f, threshold=2, fanout=4)
    assert d.fetched(report("b")) == []
    f.now = 1.0
    got = d.fetched(report("c", pages=3))  # the hot prefix: the 3 pages both passed
    assert [(r.target, r.source, r.keys) for r in got] == [
        ("b", "a", KEYS[:3]),
        ("d", "a", KEYS[:3]),
    ]
    # c (this fetch's reader) holds it already, though the index may not say so yet.
    assert [(c[0], c[1], c[2], c[3]) for c in f.copies] == [
        ("b", "a", list(TOKENS[:6]), "ns"),
        ("d", "a", list(TOKENS[:6]), "ns"),
    ]
    assert d.policy.used == {"a": 0, "b": 3, "c": 0, "d": 3}
    f.copies[0][4](COMMITTED)
    f.copies[1][4]("transfer_failed")
    assert d.policy.used == {"a": 0, "b": 3, "c": 0, "d": 0} and d.failed == 1


def test_a_node_that_leaves_takes_its_replicas_with_it():
    f = Fabric()
    d = director(f, threshold=1, fanout=1)
    (r,) = d.fetched(report("c"))
    d.leave(r.target)
    assert r.target not in d.policy.used and not d.policy.replicas


def test_off_nothing_is_copied():
    f = Fabric()
    d = director(f, enabled=False, threshold=1)
    assert d.fetched(report("b")) == [] and f.copies == []
