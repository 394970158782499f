"""Epoch claims (actors/epochs.py) over a key-value store with put-if-absent: later
claims of one identity are higher, concurrent ones distinct, whatever the hint says."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st
from kvfabric.actors.epochs import _key, claim_epoch


class DictKV:
    """The GCS store's contract, in memory: put-if-absent is atomic."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.lock = threading.Lock()

    def get(self, key: bytes) -> bytes | None:
        with self.lock:
            return self.data.get(key)

    def put(self, key: bytes, value: bytes, overwrite: bool) -> bool:
        with self.lock:
            existed = key in self.data
            if overwrite or not existed:
                self.data[key] = value
            return existed


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 5)), max_size=30))
def test_sequential_claims_increase_per_identity_whatever_the_hint(steps):
    """A hint left behind (a racing claim wrote an older one last) costs retries only."""
    kv, last = DictKV(), {}
    for identity, rewind in steps:
        hint = kv.get(_key(identity))
        if hint and rewind:
            kv.put(_key(identity), str(max(0, int(hint) - rewind)).encode(), True)
        epoch = claim_epoch(kv, identity)
        assert epoch > last.get(identity, 0)
        last[identity] = epoch


def test_concurrent_claims_are_distinct_and_each_claimer_sees_them_rise():
    kv = DictKV()
    got: list[list[int]] = [[] for _ in range(6)]

    def claimer(out: list[int]) -> None:
        for _ in range(50):
            out.append(claim_epoch(kv, "node"))

    threads = [threading.Thread(target=claimer, args=(out,)) for out in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    flat = [e for out in got for e in out]
    assert len(flat) == len(set(flat)) == 300
    assert all(out == sorted(out) and len(set(out)) == len(out) for out in got)
    assert claim_epoch(kv, "node") == 301  # contiguous: the next is above all
